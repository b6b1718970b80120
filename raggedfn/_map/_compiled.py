"""``raggedfn.map`` inside ``torch.compile``: the plan is chosen while dynamo traces.

Dynamo inlines ``map``'s Python code. The cache lookup runs as an
``assume_constant_result`` function (a constant to dynamo: no guards on the
cache's own dicts, so tracing other functions never recompiles this graph).
Choosing among the cached variants runs their compiled dependency check
(:meth:`Deps.compiled_check`) as ordinary traced code: dynamo guards on every
Python value it reads (``module.training``, a captured number) and turns every
tensor it reads into a graph input, so a changed state recompiles and a rebound
parameter does not. Functions made inside the compiled region (a lambda in the
loss) have closures dynamo cannot expose as attributes: :func:`cell` and
:func:`global_of` read them from dynamo's own view of the function.

A function that has no trace yet is traced while dynamo runs (trace on first
use) when ``f`` is a function or module that exists outside the compiled region;
a lambda made inside it needs one eager call first (its captured values exist
only as graph values while compiling). Inside the graph nothing can fall back:
guards and size classes are checked on device (``torch._assert_async``), and an
op without a batching rule raises ``RaggedError`` naming it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.comptime import comptime

from .._errors import fail
from .._layout import Axis, Layout
from .._ragged import Ragged
from . import _cache
from ._trace import _HINTS, _LOCK, leaf_kinds, signature  # noqa: F401

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


def _static(leaves: list[Any], kinds: list[str], treespec: Any, dims: Any) -> tuple[Any, ...]:
    return (dims, str(treespec), signature(leaves, kinds))


@torch._dynamo.assume_constant_result
def _candidates(key: Any, static: tuple[Any, ...]) -> tuple[Any, ...]:
    """Cached variants for this function and signature (any size classes)."""
    state = _cache.global_state()
    with _LOCK:
        entry = _cache.entry_of_key(key, create=False)
        if entry is None:
            return ()
        return tuple(
            v for v in entry.variants if v.static[:3] == static and v.static[4] == state and v.plans
        )


@torch._dynamo.assume_constant_result
def _trace_now(f: Any, static: tuple[Any, ...], structure: Any) -> Any:
    """Trace ``f`` while dynamo runs (``f`` is a real function or module)."""
    from ._api import _new_variant
    from ._trace import is_ragged_leaf

    dims, spec_text, sig = static
    leaves, kinds = _stand_ins(sig)
    if leaves is None or structure is None:
        return None
    treespec = torch.utils._pytree.tree_flatten(_rebuild(structure), is_leaf=is_ragged_leaf)[1]
    classes = tuple(range(sum(sum(1 for r, _ in s[1] if r) for s in sig if s[0] == "R")))
    full_static = (dims, spec_text, sig, classes, _cache.global_state())
    with _LOCK:
        entry = _cache.entry_of(f, create=True)
        assert entry is not None
        entry.traces += 1
        variant, _, cacheable = _new_variant(
            f, [(f, "f")], full_static, leaves, kinds, treespec, classes
        )
        if variant.failure is None and cacheable:
            _cache.add(entry, variant)
        return variant


def _describe(value: Any) -> Any:
    """The container structure of the arguments as constants (None: unsupported)."""
    if isinstance(value, (Ragged, torch.Tensor)):
        return "leaf"
    if type(value) in (tuple, list):
        parts = tuple(_describe(v) for v in value)
        return None if None in parts else (type(value).__name__, parts)
    if type(value) is dict:
        keys = tuple(value)
        parts = tuple(_describe(value[k]) for k in keys)
        return None if None in parts else ("dict", keys, parts)
    if type(value) in (bool, int, float, complex, str, bytes, type(None)):
        return "leaf"
    return None


def _rebuild(structure: Any) -> Any:
    if structure == "leaf":
        return _Slot()
    if structure[0] == "dict":
        return {k: _rebuild(v) for k, v in zip(structure[1], structure[2], strict=True)}
    parts = [_rebuild(v) for v in structure[1]]
    return tuple(parts) if structure[0] == "tuple" else parts


class _Slot:
    """A leaf position in a rebuilt argument structure."""


def _stand_ins(sig: tuple[Any, ...]) -> tuple[list[Any] | None, list[str]]:
    """Leaves with the metadata of a signature (what tracing reads of them)."""
    leaves: list[Any] = []
    kinds: list[str] = []
    for entry in sig:
        tag = entry[0]
        if tag == "R":
            _, axes, dtype, dense, device = entry
            layout = Layout(tuple(Axis(r, i) for r, i in axes))
            values = torch.empty((0, *dense), dtype=_dtype(dtype), device=device)
            sizes = torch.zeros(0, layout.num_ragged, dtype=torch.int64, device=device)
            offsets = torch.zeros(1, dtype=torch.int64, device=device)
            leaves.append(Ragged._make(values, offsets, sizes, layout))
            kinds.append("ragged")
        elif tag in ("D", "S"):
            _, dtype, shape, device = entry
            lead = (1,) if tag == "D" else ()
            leaves.append(torch.empty((*lead, *shape), dtype=_dtype(dtype), device=device))
            kinds.append("dense" if tag == "D" else "shared")
        elif tag == "C":
            leaves.append(entry[2])
            kinds.append("constant")
        else:  # an object argument: only its eager call can walk it
            return None, kinds
    return leaves, kinds


def _dtype(text: str) -> torch.dtype:
    return getattr(torch, text.split(".")[-1])


def compiled_map(
    f: Any,
    args: tuple[Any, ...],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    dims: Any,
    batch_size: Any,
    randomness: str,
) -> Any:
    from ._api import _columns, _roots
    from ._interpret import make_ctx, run

    static = _static(leaves, kinds, treespec, dims)
    roots = [r for r, _ in _roots(f, leaves, kinds)]
    chosen = None
    lifted: list[Any] = []
    for variant in _candidates(_cache.function_key(f), static):
        lifted = [None] * len(variant.deps.lifted)
        if variant.deps.compiled_check()(*roots, lifted):
            chosen = variant
            break
    if chosen is None:
        chosen = _trace_now(f, static, _describe(args))
        if chosen is None:
            raise fail(
                "map",
                "inside torch.compile, f could not be traced for this input signature (a "
                "function made inside the compiled region, or an object argument, needs "
                "one eager call of the step first)",
            )
        if chosen.failure is not None:
            raise fail(
                "map",
                f"inside torch.compile, f cannot run batched ({chosen.failure}) and a "
                "per-sample loop cannot run inside fullgraph=True",
            )
        lifted = [None] * len(chosen.deps.lifted)
        if not chosen.deps.compiled_check()(*roots, lifted):
            raise fail("map", "inside torch.compile, the state f reads did not match its trace")
    plan = chosen.plans[0]
    if plan.unknown:
        raise fail(
            "map",
            "inside torch.compile, f reads " + "; ".join(plan.unknown) + " from a place "
            "raggedfn does not follow; pass it as an argument (in_dims=None)",
        )
    columns = _columns(leaves, kinds)
    classes = chosen.static[3]
    for a, c in enumerate(classes):
        if c != a:
            torch._assert_async(
                (columns[a] == columns[c]).all(), "raggedfn.map: ragged sizes differ from the trace"
            )
    device = next(
        leaf.values.device if isinstance(leaf, Ragged) else leaf.device
        for leaf, k in zip(leaves, kinds, strict=True)
        if k in ("ragged", "dense")
    )
    ctx, inputs = make_ctx(plan, leaves, batch_size, device, lifted, randomness)
    for text, evaluate in plan.guards:
        ok = evaluate(ctx.env)
        if isinstance(ok, torch.Tensor):
            torch._assert_async(ok.all(), f"raggedfn.map: guard {text} fails")
        elif not ok:
            raise fail("map", f"guard {text} fails")
    return run(plan, ctx, inputs, False, None)


__all__ = ["cell", "compiled_map", "global_of"]
