"""User state as dynamo sees it while it compiles ``raggedfn.map``'s caller.

Helpers of the compiled dependency check (``_deps_check``) and of the interpreter
(``_interpret``), and of :func:`._compiled.compiled_map`: closure cells and globals of
a function dynamo made in the compiled region (:func:`cell`, :func:`global_of`),
whether it made one (:func:`made_inside`), the real function rebuilt from it for a
trace while compiling (:func:`rebuilt`), and Python floats read as constants
(:func:`static`), and a number's or string's type known from dynamo's guard on its
value (:func:`exact_type`). Outside compilation each is the plain Python read. Each reads
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


# value types whose constant guard (dynamo's EQUALS_MATCH, or its NaN check) compares
# the exact type before the value: 1, True and 1.0 fail each other's guard
_TYPED = (int, float, complex, str, bytes)

# the guard builders that guard a constant by type and value
_VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")


def _fill_exact_type(ctx: Any) -> None:
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.lazy import LazyVariableTracker

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    var = tx.symbolic_locals.get("value")
    kind = tx.symbolic_locals.get("kind")
    if var is None or kind is None:
        return
    if isinstance(var, LazyVariableTracker):
        var = var.realize()  # installs its value guard (a constant) or makes a symbol
    if type(var) is not ConstantVariable or var.source is None:
        return
    value = var.as_python_constant()
    if type(value) not in _TYPED:
        return
    by_source = getattr(tx.output.guards, "source_to_guards", None)
    if by_source is None:  # a dynamo without that index: ask plainly
        return
    guards = by_source.get(var.source, ())
    names = {getattr(getattr(g.create_fn, "func", g.create_fn), "__name__", "") for g in guards}
    if not names.intersection(_VALUE_GUARDS):
        return
    if isinstance(kind, LazyVariableTracker):
        # the check's own constant (fixed for the check): read without a guard
        expected = kind.peek_value()
    else:
        try:
            expected = kind.as_python_constant()
        except NotImplementedError:
            return
    tx.symbolic_locals["out"] = ConstantVariable.create(type(value) is expected)


def exact_type(value: Any, kind: type) -> bool:
    """``type(value) is kind``. Inside torch.compile, for a number or string dynamo
    guards by value (a constant read from user state), the answer comes from that
    guard's value without a second guard on the type: dynamo's value guard compares
    the type first (``EQUALS_MATCH``: 1, True and 1.0 fail each other's guard), so the
    answer holds for every call the graph serves. A value dynamo does not guard that
    way (a symbolic int, a value made in the compiled region) is asked plainly."""
    if not torch.compiler.is_compiling():
        return type(value) is kind
    out = None
    comptime(_fill_exact_type)
    if out is None:
        return type(value) is kind
    return out


def _unread_dict(tx: Any) -> tuple[Any, dict[Any, Any]] | None:
    """The local ``table`` as dynamo holds it, where dynamo has not read it yet (a lazy
    variable with a source) and it is a plain dict: ``(variable, the dict)``."""
    from torch._dynamo.variables.lazy import LazyVariableTracker

    var = tx.symbolic_locals.get("table")
    if not isinstance(var, LazyVariableTracker) or var.is_realized() or var.source is None:
        return None
    real = var.peek_value()
    if type(real) is not dict or not all(type(k) is str for k in real):
        return None
    return var, real


def _fill_keys(ctx: Any) -> None:
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.variables import ConstantVariable

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    found = _unread_dict(tx)
    if found is None:
        return
    var, real = found
    # its length (dynamo's dict length guard checks that it is a dict too); each key
    # read below is guarded by the lookup of its entry
    install_guard(var.source.make_guard(GuardBuilder.SEQUENCE_LENGTH))
    tx.symbolic_locals["out"] = ConstantVariable.create(tuple(real))


def _fill_entry(ctx: Any) -> None:
    from torch._dynamo.source import DictGetItemSource
    from torch._dynamo.variables.base import VariableTracker

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    found = _unread_dict(tx)
    if found is None:
        return
    var, real = found
    key = tx.symbolic_locals["key"].as_python_constant()
    if key not in real:
        return
    source = DictGetItemSource(var.source, key)
    tx.symbolic_locals["out"] = VariableTracker.build(tx, real[key], source)


def keys_of(table: dict[str, Any]) -> tuple[str, ...]:
    """``tuple(table)``, for a module's parameter, buffer and submodule dicts. Inside
    torch.compile, guarded by the dict's length alone: dynamo's own read of a dict adds
    a guard on its type, which the length guard (a dict's) and the lookups of its
    entries (:func:`entry_of`, each key) make redundant, one guard per dict."""
    if not torch.compiler.is_compiling():
        return tuple(table)
    out = _MISSING
    comptime(_fill_keys)
    if out is _MISSING:
        return tuple(table)
    return out  # type: ignore[return-value]


def entry_of(table: dict[str, Any], key: str) -> Any:
    """``table[key]`` (see :func:`keys_of`): inside torch.compile read through the dict
    without dynamo reading the dict itself."""
    if not torch.compiler.is_compiling():
        return table[key]
    out = _MISSING
    comptime(_fill_entry)
    if out is _MISSING:
        return table[key]
    return out


def made_inside(f: Any) -> bool:
    """Whether dynamo made ``f`` in the compiled region with values only it knows."""
    if not torch.compiler.is_compiling():
        return False
    out = False
    comptime(_fill_made_inside)
    return out


def _real(tx: Any, var: Any, depth: int) -> Any:
    """The real Python value behind a variable dynamo holds (``LookupError``: none)."""
    from torch._dynamo.variables import (
        ConstDictVariable,
        ListVariable,
        NNModuleVariable,
        TupleVariable,
        UserDefinedObjectVariable,
    )
    from torch._dynamo.variables.functions import NestedUserFunctionVariable

    if depth > 8:
        raise LookupError("captured values nested too deep")
    if hasattr(var, "realize"):
        var = var.realize()
    if var.is_tensor():
        # computed from the frame's real inputs (dynamo runs the graph so far)
        real = var.get_real_value()
        # inside a torch.func transform dynamo's variable says requires_grad=False; its
        # example value (the transform's wrapper) says what an eager call would see
        example = var.proxy.node.meta.get("example_value")
        wants = bool(getattr(example, "requires_grad", real.requires_grad))
        if wants != real.requires_grad and (real.is_floating_point() or real.is_complex()):
            # (not requires_grad_: the hook runs inside the transform, which refuses it)
            real = torch.Tensor._make_subclass(torch.Tensor, real.detach(), wants)
        return real
    if isinstance(var, NestedUserFunctionVariable):
        return _rebuild(tx, var, depth + 1)
    if isinstance(var, (UserDefinedObjectVariable, NNModuleVariable)):
        return var.value
    if type(var) is ConstDictVariable:
        return {k.vt.as_python_constant(): _real(tx, v, depth + 1) for k, v in var.items.items()}
    if type(var) in (ListVariable, TupleVariable):
        items = [_real(tx, v, depth + 1) for v in var.items]
        return items if type(var) is ListVariable else tuple(items)
    try:
        return var.as_python_constant()
    except Exception as error:
        raise LookupError(f"a captured {type(var).__name__}") from error


def _rebuild(tx: Any, fvar: Any, depth: int) -> Any:
    import types

    cells = []
    for cell_var in fvar.closure.items if fvar.closure else ():
        contents = tx.output.side_effects.load_cell(cell_var)
        if contents is fvar:
            raise LookupError("a function capturing itself")
        cells.append(types.CellType(_real(tx, contents, depth)))
    fn = types.FunctionType(
        fvar.code.as_python_constant(),
        fvar.f_globals,
        fvar.fn_name.as_python_constant(),
        None,
        tuple(cells) if fvar.closure else None,
    )
    if fvar.defaults:
        fn.__defaults__ = _real(tx, fvar.defaults, depth + 1)
    if fvar.kwdefaults:
        fn.__kwdefaults__ = _real(tx, fvar.kwdefaults, depth + 1)
    return fn


def _summary(value: Any, depth: int = 0) -> Any:
    """What tells captured values apart for one compile (a memo key)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, dict) and depth < 8:
        return ("d", tuple((k, _summary(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (list, tuple)) and depth < 8:
        return (type(value).__name__, tuple(_summary(v, depth + 1) for v in value))
    if type(value) in (bool, int, float, complex, str, bytes, type(None)):
        return value
    return ("id", id(value))


def _fill_rebuilt(ctx: Any) -> None:
    from torch._dynamo.variables import ConstantVariable

    found = _nested(ctx)
    if found is None:
        return
    tx, fvar = found
    try:
        fn = _rebuild(tx, fvar, 0)
    except Exception as error:  # a captured value only the graph has (under a transform)
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        tx.symbolic_locals["out"] = ConstantVariable.create(reason)
        return
    cells = tuple(_summary(c.cell_contents) for c in fn.__closure__ or ())
    token = ("rebuilt", id(fn.__code__), repr(cells))
    try:
        context = torch._guards.CompileContext.get()
    except Exception:
        return
    # the first one for this code and these captured values: dynamo's restarts of the
    # frame's analysis rebuild it, and must find the trace of the first pass
    context.__dict__.setdefault("_raggedfn_rebuilt", {}).setdefault(token, fn)
    tx.symbolic_locals["out"] = ConstantVariable.create(token)


def _fill_one_graph(ctx: Any) -> None:
    from torch._dynamo.variables import ConstantVariable

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    strict = bool(getattr(tx, "one_graph", True)) or bool(getattr(tx, "error_on_graph_break", 0))
    tx.symbolic_locals["out"] = ConstantVariable.create(strict)


def one_graph() -> bool:
    """Whether the frame dynamo compiles refuses graph breaks (``fullgraph=True``, or
    ``error_on_graph_break``); False outside compilation."""
    if not torch.compiler.is_compiling():
        return False
    out = True
    comptime(_fill_one_graph)
    return out


def rebuilt(f: Any) -> Any:
    """For ``f`` made by dynamo in the compiled region: a token (a tuple) naming a real
    function equal to it (its code, globals, defaults, and closure cells holding the
    real values it captured: modules, numbers, and the real values of captured tensors,
    which dynamo computes from the frame's inputs), for :func:`rebuilt_function` while
    this compile runs; a string saying why not (a value captured under a
    ``torch.func`` transform has no real value); ``None`` outside compilation."""
    if not torch.compiler.is_compiling():
        return None
    out: Any = "dynamo did not expose the function"
    comptime(_fill_rebuilt)
    return out


def rebuilt_function(token: Any) -> Any:
    """The function a :func:`rebuilt` token names (during the same compile)."""
    return torch._guards.CompileContext.get().__dict__["_raggedfn_rebuilt"][token]


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


__all__ = [
    "cell",
    "entry_of",
    "exact_type",
    "global_of",
    "keys_of",
    "made_inside",
    "one_graph",
    "rebuilt",
    "rebuilt_function",
    "static",
]
