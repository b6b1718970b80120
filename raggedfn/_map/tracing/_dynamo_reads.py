"""User state as dynamo sees it while it compiles ``raggedfn.map``'s caller.

Helpers of the compiled dependency check (``_deps_check``) and of the interpreter
(``_interpret``), and of :func:`._compiled.compiled_map`: closure cells and globals of
a function dynamo made in the compiled region (:func:`cell`, :func:`global_of`),
whether it made one (:func:`made_inside`), and Python floats read as constants
(:func:`static`). Outside compilation each is the plain Python read. Each reads
dynamo's own view through a ``comptime`` hook (the ``_fill_*`` functions), which
dynamo calls while it traces the caller.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.comptime import comptime

_MISSING = object()


def _nested(ctx: Any) -> tuple[Any, Any] | None:
    from torch._dynamo.variables.functions import NestedUserFunctionVariable

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    fvar = tx.symbolic_locals.get("f")
    if isinstance(fvar, NestedUserFunctionVariable):
        return tx, fvar
    return None


def _fill_cell(ctx: Any) -> None:
    found = _nested(ctx)
    if found is None:
        return
    tx, fvar = found
    i = tx.symbolic_locals["i"].as_python_constant()
    tx.symbolic_locals["out"] = tx.output.side_effects.load_cell(fvar.closure.items[i])


def _fill_global(ctx: Any) -> None:
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables.builder import VariableBuilder

    found = _nested(ctx)
    if found is None:
        return
    tx, fvar = found
    name = tx.symbolic_locals["name"].as_python_constant()
    module = fvar.f_globals["__name__"]
    source = AttrSource(tx.import_source(module), name)
    tx.symbolic_locals["out"] = VariableBuilder(tx, source)(fvar.f_globals[name])


def _fill_made_inside(ctx: Any) -> None:
    from torch._dynamo.variables import ConstantVariable

    found = _nested(ctx)
    if found is not None and not found[1].is_python_constant():
        tx = found[0]
        tx.symbolic_locals["out"] = ConstantVariable.create(True)


def _realize_static(ctx: Any) -> None:
    from torch._dynamo.variables import BaseListVariable, ConstDictVariable
    from torch._dynamo.variables.lazy import LazyVariableTracker

    def realize(var: Any, depth: int) -> None:
        if issubclass(type(var), LazyVariableTracker):
            if var.is_realized():
                var = var.unwrap()
            elif var.peek_type() is float:
                with torch._dynamo.config.patch(specialize_float=True):
                    var.realize()
                return
            elif var.peek_type() in (tuple, list, dict) and depth < 3:
                var = var.realize()
            else:
                return
        if depth >= 3:
            return
        if isinstance(var, BaseListVariable):
            for item in var.items:
                realize(item, depth + 1)
        elif isinstance(var, ConstDictVariable):
            for item in var.items.values():
                realize(item, depth + 1)

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    realize(tx.symbolic_locals.get("value"), 0)


def static(value: Any) -> Any:
    """``value`` (a Python float read from user state or from a plan, or a tuple, list or
    dict holding such floats), read by dynamo as constants guarded by their value.

    Under ``dynamic=True`` dynamo turns every float it reads from an object into a
    graph input (a symbolic float); the first comparison or branch on it specialises
    it, and its tensorify pass then restarts the analysis of the whole frame, one
    restart for every few floats (a BERT through ``map``: 8 restarts of a 15 s
    trace). Realising the value here with dynamo's ``specialize_float`` makes it a
    constant from the start: one analysis, and a value guard as for any constant."""
    if torch.compiler.is_compiling():
        comptime(_realize_static)
    return value


def made_inside(f: Any) -> bool:
    """Whether dynamo made ``f`` in the compiled region with values only it knows."""
    if not torch.compiler.is_compiling():
        return False
    out = False
    comptime(_fill_made_inside)
    return out


def cell(f: Any, i: int) -> Any:
    """``f.__closure__[i].cell_contents``, also for a function dynamo made."""
    if not torch.compiler.is_compiling():
        return f.__closure__[i].cell_contents
    out = _MISSING
    comptime(_fill_cell)
    if out is _MISSING:
        return f.__closure__[i].cell_contents
    return out


def global_of(f: Any, name: str) -> Any:
    """``f.__globals__[name]``, also for a function dynamo made."""
    if not torch.compiler.is_compiling():
        return f.__globals__[name]
    out = _MISSING
    comptime(_fill_global)
    if out is _MISSING:
        return f.__globals__[name]
    return out


__all__ = ["cell", "global_of", "made_inside", "static"]
