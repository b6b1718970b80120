"""``raggedfn.map`` inside ``torch.compile``: the plan is chosen while dynamo traces.

Dynamo inlines ``map``'s Python code. The cache lookup runs as an
``assume_constant_result`` function (a constant to dynamo: no guards on the
cache's own dicts, so tracing other functions never recompiles this graph).
Choosing among the cached variants runs their compiled dependency check
(:meth:`Deps.compiled_check`) as ordinary traced code: dynamo guards on every
Python value it reads (``module.training``, a captured number) and turns every
tensor it reads into a graph input, so a changed state recompiles and a rebound
parameter does not. Functions made inside the compiled region (a lambda in the
loss) have closures dynamo cannot expose as attributes: ``_dynamo_reads.cell`` and
``global_of`` read them from dynamo's own view of the function.

A function that has no trace yet is traced while dynamo runs (trace on first
use): a function or module that exists outside the compiled region as it is; a
lambda made inside it (the per-sample lambda of a loss) as the real function
rebuilt from dynamo's view of it (``_dynamo_reads.rebuilt``: its code, and
closure cells holding the modules, numbers and real tensor values it captured).
Where a captured value has no real counterpart, a ``RaggedError`` asks for one
eager call first. Inside the graph nothing can fall back:
guards and size classes are checked on device (``torch._assert_async``), and an
op without a batching rule raises ``RaggedError`` naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _disable_current_modes

from ..._errors import fail
from ..._layout import Layout
from ..._ragged import Ragged
from ..caching import _cache
from ..caching._lookup import lookup, prepare, roots_of
from ..running._interpret import make_ctx, run
from ..running._split import as_structure, empty_samples
from ..tracing._deps import walk
from ..tracing._dynamo_reads import made_inside, one_graph, rebuilt, rebuilt_function
from ..tracing._signature import size_columns
from ..tracing._trace import LOCK, is_ragged_leaf


def _coarse(sig: tuple[Any, ...]) -> tuple[Any, ...]:
    """A signature without sizes and constant values: what dynamo sees as constants
    under ``dynamic=True`` (dense sizes and Python numbers become symbols there)."""
    out: list[Any] = []
    for entry in sig:
        if entry[0] == "R":
            out.append(("R", entry[1], entry[2], entry[4]))
        elif entry[0] in ("D", "S"):
            out.append((entry[0], entry[1], len(entry[2]), entry[3]))
        else:
            out.append((entry[0], entry[1]))
    return tuple(out)


def _loose(leaves: list[Any], kinds: list[str], treespec: Any, dims: Any) -> tuple[Any, ...]:
    out: list[Any] = []
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged":
            axes = tuple((a.ragged, a.index) for a in leaf.layout.axes)
            out.append(("R", axes, str(leaf.values.dtype), str(leaf.values.device)))
        elif kind in ("dense", "shared"):
            tag = "D" if kind == "dense" else "S"
            out.append((tag, str(leaf.dtype), leaf.ndim - (kind == "dense"), str(leaf.device)))
        elif type(leaf) in (bool, int, float, complex, str, bytes, type(None)):
            out.append(("C", type(leaf)))
        else:
            out.append(("O", type(leaf)))
    return (dims, str(treespec), tuple(out))


def _fits(sig: tuple[Any, ...], leaves: list[Any]) -> bool:
    """Dense sizes and constants of the arguments equal the variant's (guarded by dynamo)."""
    for entry, leaf in zip(sig, leaves, strict=True):
        tag = entry[0]
        if tag == "R" and tuple(leaf.values.shape[1:]) != entry[3]:
            return False
        if tag == "D" and tuple(leaf.shape[1:]) != entry[2]:
            return False
        if tag == "S" and tuple(leaf.shape) != entry[2]:
            return False
        if tag == "C" and leaf != entry[2]:
            return False
    return True


def _memo(kind: str, key: Any, compute: Any) -> Any:
    """One answer per frame compile: dynamo may restart the analysis of a frame, and
    the second pass must see the answers of the first (a trace made in the first pass
    must not send the second pass down another path). The answers live on dynamo's
    compile context, which spans the restarts of one compile."""
    try:
        context = torch._guards.CompileContext.get()
    except Exception:
        return compute()
    answers = context.__dict__.setdefault("_raggedfn_answers", {})
    slot = (kind, key)
    if slot not in answers:
        answers[slot] = compute()
    return answers[slot]


@torch._dynamo.assume_constant_result
def _candidates(key: Any, loose: tuple[Any, ...]) -> tuple[Any, ...]:
    """Cached variants for this function and argument kinds (any sizes, any classes)."""
    return _memo("candidates", (key, loose), lambda: _find_candidates(key, loose))


def _find_candidates(key: Any, loose: tuple[Any, ...]) -> tuple[Any, ...]:
    state = _cache.global_state()
    dims, spec_text, coarse = loose
    with LOCK:
        entry = _cache.entry_of_key(key, create=False)
        if entry is None:
            return ()
        return tuple(
            v.vid
            for v in entry.variants
            if v.static[0] == dims
            and v.static[1] == spec_text
            and _coarse(v.static[2]) == coarse
            and v.static[4] == state
            and v.plans
        )


def _registered(vid: str) -> Any:
    """The cached variant ``vid``. Dynamo reads the registry's attribute live (a
    variant traced while compiling is found) and guards that one attribute; the
    variant itself sits in its holder's ``__annotations__``, through which dynamo
    installs no guard (``torch._dynamo.variables.functions.fn_var_getattr``). What is
    read from a variant (its signature, its compiled check and the constants in that
    check's closure, its plan, which the interpreter walks) is map's own data, fixed
    once the variant exists, so it needs none: the guards left are those the check
    installs on what ``f`` reads (module state, captured numbers, tensor metadata)."""
    return getattr(_cache.REGISTRY, vid).__annotations__["variant"]


@torch._dynamo.assume_constant_result
def _empty_hooks_unguarded() -> bool:
    """Whether dynamo skips the guards of empty module hooks (its default): then the
    compiled check does too (``Deps.compiled_lean``)."""
    return bool(torch._dynamo.config.skip_nnmodule_hook_guards)


def _check(variant: Any) -> Any:
    deps = variant.deps
    return deps.compiled_lean if _empty_hooks_unguarded() else deps.compiled_check


@torch._dynamo.assume_constant_result
def _trace_now(f: Any, token: Any, structure: Any, dims: Any, layouts: Any, *flat: Any) -> Any:
    """Trace ``f`` while dynamo runs: ``f`` is a real function or module (or ``None``
    and ``token`` names the real function rebuilt from one dynamo made), and dynamo
    hands the argument tensors over with their real values (example inputs)."""
    f, key = real_function(f, token, structure, dims, layouts, _shapes(flat))
    return _memo("trace", key, lambda: _trace(f, structure, dims, layouts, flat))


def _shapes(flat: tuple[Any, ...]) -> tuple[Any, ...]:
    """What tells two calls of the same ``f`` in one compiled frame apart besides their
    structure: the argument tensors' shapes and dtypes (two calls on different feature
    sizes need two traces; a restart of the frame's analysis sees the same ones)."""
    return tuple(
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in flat
    )


def real_function(f: Any, token: Any, *static: Any) -> tuple[Any, Any]:
    """The real ``f`` (rebuilt from ``token`` when dynamo made it) and the key of its
    trace or record under the argument structure ``static``."""
    if token is not None:
        return rebuilt_function(token), (token, *static)
    return f, (_cache.function_key(f), id(f), *static)


def rebuild_args(structure: Any, layouts: Any, flat: tuple[Any, ...]) -> Any:
    """``map``'s arguments from the flat tensors dynamo handed over: per leaf, ``None``
    (the tensor itself), a layout code (a one-level ``Ragged``: values, offsets, sizes)
    or ``(code, levels)`` (a nested one: those and one row tensor per level)."""
    leaves: list[Any] = []
    it = iter(flat)
    for layout in layouts:
        if layout is None:
            leaves.append(next(it))
            continue
        code, count = layout if isinstance(layout, tuple) else (layout, 0)
        values, offsets, sizes = next(it), next(it), next(it)
        rows = tuple(next(it) for _ in range(count))
        leaves.append(Ragged._make(values, offsets, sizes, Layout(code), rows))
    return torch.utils._pytree.tree_unflatten(
        leaves,
        torch.utils._pytree.tree_flatten(_rebuild(structure), is_leaf=is_ragged_leaf)[1],
    )


def _trace(f: Any, structure: Any, dims: Any, layouts: Any, flat: tuple[Any, ...]) -> Any:
    if structure is None:
        return None
    args = rebuild_args(structure, layouts, flat)
    dims, leaves, treespec, kinds, _ = prepare("map", args, dims)
    # outside dynamo's tracing context: make_fx must use raggedfn's own fake mode and
    # shape environment, not the one of the graph being compiled
    with torch._guards.tracing(None), unset_fake_temporarily(), _outside_outer_trace():
        variant, _, _, classes = lookup(f, leaves, kinds, treespec, dims)
        fake = any(
            isinstance(leaf.sizes, FakeTensor) for leaf in leaves if isinstance(leaf, Ragged)
        )
        if variant.failure is not None and fake and len(set(classes)) > 1:
            # torch.export traces on fake inputs: no data tells which ragged axes have
            # equal sizes, so they were traced as unrelated. Where that fails (t + u of
            # two inputs of equal lengths), trace them as one size, which every call
            # then checks on its sizes (an input where they differ raises)
            again, _, _, _ = lookup(f, leaves, kinds, treespec, dims, (0,) * len(classes))
            if again.failure is None:
                variant = again
    if variant.failure is not None:
        return _failure(variant.failure)
    _cache.REGISTRY.setdefault(variant.vid, variant)
    return variant.vid


@contextlib.contextmanager
def _outside_outer_trace() -> Iterator[None]:
    """No mode of an enclosing trace (``torch.export``'s non-strict tracing: its proxy,
    fake and torch-function modes) sees the trace of ``f``, which has its own; a
    ``with torch.device(...)`` around the call still applies inside."""
    functions = []
    while torch._C._len_torch_function_stack() > 0:
        functions.append(torch._C._pop_torch_function_stack())
    kept = [m for m in reversed(functions) if isinstance(m, DeviceContext)]
    try:
        with _disable_current_modes(), contextlib.ExitStack() as stack:
            for mode in kept:
                stack.enter_context(mode)
            yield
    finally:
        for mode in reversed(functions):
            torch._C._push_on_torch_function_stack(mode)


def _failure(reason: str) -> str:
    failed = _cache.Variant((), walk([]), failure=reason)
    _cache.REGISTRY[failed.vid] = failed
    return failed.vid


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


# compiled_map's answer where the call must run eagerly, outside the graph
EAGER = object()


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
    loose = _loose(leaves, kinds, treespec, dims)
    roots = [r for r, _ in roots_of(f, leaves, kinds)]
    chosen = None
    lifted: list[Any] = []
    for vid in _candidates(_cache.function_key(f), loose):
        variant = _registered(vid)
        if not _fits(variant.static[2], leaves):
            continue
        lifted = [None] * len(variant.deps.lifted)
        if _check(variant)(*roots, lifted):
            chosen = variant
            break
    token = None
    if chosen is None and made_inside(f):
        # a function made in the compiled region (a lambda in the loss): traced as the
        # real function rebuilt from dynamo's view of it, with the real values it captured
        token = rebuilt(f)
        if type(token) is str:
            raise fail(
                "map",
                "inside torch.compile, f was made in the compiled region and captures a "
                f"value that exists only as a graph value while compiling ({token}); call "
                "the step once eagerly first (that traces f), or pass the value to map as "
                "an argument (in_dims=None)",
            )
    if chosen is None:
        layouts: list[str | None] = []
        flat: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, Ragged):
                layouts.append(leaf.layout.code)
                flat.extend((leaf.values, leaf.offsets, leaf.sizes))
            else:
                layouts.append(None)
                flat.append(leaf)
        traced = None if token is not None else f
        vid = _trace_now(traced, token, _describe(args), dims, tuple(layouts), *flat)
        chosen = _registered(vid) if vid is not None else None
        if chosen is None:
            raise fail(
                "map",
                "inside torch.compile, f has no trace for this input signature and cannot "
                "be traced while compiling (a function made inside the compiled region needs "
                "one eager call of the step first)",
            )
        if chosen.failure is not None:
            if not one_graph():
                # graph breaks are allowed: map runs outside the graph (eagerly, the
                # per-sample loop, which raises f's own exception where f raises)
                return EAGER
            raise fail(
                "map",
                f"inside torch.compile, f cannot run batched ({chosen.failure}) and a "
                "per-sample loop cannot run inside fullgraph=True",
            )
        lifted = [None] * len(chosen.deps.lifted)
        if not _check(chosen)(*roots, lifted):
            raise fail("map", "inside torch.compile, the state f reads did not match its trace")
    plan = chosen.plans[0]
    if plan.unknown:
        raise fail(
            "map",
            "inside torch.compile, f reads " + "; ".join(plan.unknown) + " from a place "
            "raggedfn does not follow; pass it as an argument (in_dims=None)",
        )
    columns = size_columns(leaves, kinds)
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
    empty = empty_samples(leaves, kinds, batch_size, device)
    for text, evaluate in plan.guards:
        ok = evaluate(ctx.env)
        if isinstance(ok, torch.Tensor):
            if text in plan.internal:
                # torch's own code ruled empty samples out (an SDPA kernel choice,
                # ``numel() == 0`` shortcuts): eagerly they run per sample; here the
                # batched rules, which follow torch per sample for them, run them
                ok = ok | empty
            torch._assert_async(ok.all(), f"raggedfn.map: guard {text} fails")
        elif not ok:
            raise fail("map", f"guard {text} fails")
    out = run(plan, ctx, inputs, False, None)
    if plan.pinned or plan.guards:
        # fixed sizes of a trace under guards become ragged where f's are, as eagerly
        out = as_structure(out, chosen.structure)
    return out


__all__ = ["EAGER", "compiled_map"]
