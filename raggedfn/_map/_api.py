"""``raggedfn.map``, ``raggedfn.map_report`` and ``raggedfn.map_cache_info``."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._errors import RaggedError, RaggedPerformanceWarning, describe, fail
from .._ragged import Ragged
from . import _cache
from ._cache import CacheInfo, Variant
from ._compiled import compiled_map
from ._deps import walk
from ._fallback import function_loop, output_specs
from ._interpret import LateGuardFailed, Recorder, guard_mask, make_ctx, run
from ._report import MapReport
from ._sizes import Unsupported
from ._split import empty_result, empty_samples, merge, ragged_positions_of, take
from ._trace import (
    _HINTS,
    _LOCK,
    Plan,
    TSpec,
    is_ragged_leaf,
    leaf_kinds,
    signature,
    trace,
    tracing,
)

_RANDOMNESS = ("different", "same", "error")
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _normalize_in_dims(fn: str, in_dims: Any, count: int) -> tuple[Any, ...]:
    if isinstance(in_dims, int) or in_dims is None:
        dims = (in_dims,) * count
    elif isinstance(in_dims, (tuple, list)):
        dims = tuple(in_dims)
    else:
        raise fail(fn, f"in_dims must be an int, None or a tuple, got {describe(in_dims)}")
    if len(dims) != count:
        raise fail(fn, f"in_dims has {len(dims)} entries but {count} arguments were given")
    for d in dims:
        if d not in (0, None):
            raise fail(fn, f"in_dims entries must be 0 or None, got {d!r}")
    return dims


def _prepare(fn_name: str, args: tuple[Any, ...], in_dims: Any) -> tuple[Any, ...]:
    dims = _normalize_in_dims(fn_name, in_dims, len(args))
    leaves, treespec = pytree.tree_flatten(args, is_leaf=is_ragged_leaf)
    mapped: list[bool] = []
    for a, d in zip(args, dims, strict=True):
        count = len(pytree.tree_leaves(a, is_leaf=is_ragged_leaf))
        mapped.extend([d == 0] * count)
    kinds = leaf_kinds(leaves, mapped)
    batch_sizes: list[Any] = []
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged":
            batch_sizes.append(leaf.batch_size)
        elif kind == "dense":
            if leaf.ndim == 0:
                raise fail(
                    fn_name,
                    "a mapped tensor (in_dims=0) needs a leading batch axis, got a 0-d tensor",
                )
            batch_sizes.append(leaf.shape[0])
    for leaf, m in zip(leaves, mapped, strict=True):
        if m and not isinstance(leaf, (Ragged, torch.Tensor)):
            raise fail(
                fn_name,
                f"a mapped argument (in_dims=0) must be a Ragged or a tensor, got {describe(leaf)}",
            )
    if not batch_sizes:
        raise fail(fn_name, "no argument is mapped: give at least one Ragged or in_dims=0 tensor")
    # no int(): while compiling the batch size stays symbolic (one graph for every B)
    if not torch.compiler.is_compiling() and len({int(b) for b in batch_sizes}) != 1:
        raise fail(
            fn_name,
            f"mapped arguments disagree on the batch size: {sorted({int(b) for b in batch_sizes})}",
        )
    return dims, leaves, treespec, kinds, batch_sizes[0]


def _columns(leaves: list[Any], kinds: list[str]) -> list[torch.Tensor]:
    """``[B]`` sizes of every ragged axis of every mapped input, flattened in order."""
    return [
        leaf.sizes[:, k]
        for leaf, kind in zip(leaves, kinds, strict=True)
        if kind == "ragged"
        for k in range(leaf.num_ragged)
    ]


def size_classes(leaves: list[Any], kinds: list[str]) -> tuple[int, ...]:
    """For every ragged axis of every mapped input: the first axis whose sizes equal its
    own in every sample (one host sync). Equal axes share one symbol in the trace, so
    ``p + p.transpose(0, 1)`` on square pair states, or pair and token inputs of the
    same length, trace without a size mismatch."""
    columns = _columns(leaves, kinds)
    if len(columns) < 2:
        return tuple(range(len(columns)))
    table = torch.stack(columns, 1)
    equal = (table[:, :, None] == table[:, None, :]).all(0).tolist()
    return tuple(row.index(True) for row in equal)


def _roots(f: Any, leaves: list[Any], kinds: list[str]) -> list[tuple[Any, str]]:
    """What the dependency walk starts from: ``f`` and the non-scalar shared constants
    (a module passed with ``in_dims=None`` is read like a captured one)."""
    roots: list[tuple[Any, str]] = [(f, "f")]
    for i, (leaf, kind) in enumerate(zip(leaves, kinds, strict=True)):
        if kind == "constant" and type(leaf) not in _SCALARS:
            roots.append((leaf, f"argument leaf {i}"))
    return roots


def _warn(variant: Variant | None, what: str) -> None:
    if variant is not None:
        if what in variant.warned:
            return
        variant.warned.add(what)
    warnings.warn(f"raggedfn.map: {what}", RaggedPerformanceWarning, stacklevel=4)


def _new_variant(
    f: Any,
    roots: list[tuple[Any, str]],
    static: tuple[Any, ...],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    classes: tuple[int, ...],
) -> tuple[Variant, list[Any], bool]:
    """Walk what ``f`` reads and trace a first plan; ``(variant, lifted, cacheable)``."""
    deps = walk(roots)
    lifted: list[Any] = [None] * len(deps.lifted)
    if not deps.check(*(r for r, _ in roots), lifted):
        raise fail("map", "the state f reads changed while it was being read")
    variant = Variant(static, deps)
    hints = tuple(_HINTS[c % len(_HINTS)] for c in range(len(classes)))
    plan = _trace_plan(f, leaves, kinds, treespec, classes, hints, deps)
    probe_hints = _probe_hints(len(classes))
    needed = not (isinstance(plan, Plan) and _holds_at(plan, classes, probe_hints))
    variant.structure, probe = _structure(
        plan,
        (lambda: _trace_plan(f, leaves, kinds, treespec, classes, probe_hints, deps))
        if needed
        else None,
    )
    if isinstance(plan, Failure):
        variant.failure = plan.reason
        if plan.specs is not None and plan.out_spec is not None:
            variant.empty = (plan.specs, plan.out_spec)
        return variant, lifted, True
    variant.plans.append(plan)
    if isinstance(probe, Plan) and not probe.unknown:
        variant.plans.append(probe)  # a plan for small samples, traced anyway
    return variant, lifted, not plan.unknown


# example sizes of the probe trace: small (below the thresholds of most branches on
# sizes, ``t[:min(3, n)]``), distinct per size class, and never 0 or 1 (torch's own
# special cases)
def _probe_hints(count: int) -> tuple[int, ...]:
    return tuple(2 + c for c in range(count))


def _holds_at(plan: Plan, classes: tuple[int, ...], hints: tuple[int, ...]) -> bool:
    """Whether every guard of ``plan`` holds with these example sizes per size class
    (then a trace on them takes the same branches, and adds nothing), never for a
    pinned trace."""
    if plan.pinned:
        return False
    env: dict[str, Any] = {}
    axis = 0
    for kind in plan.leaf_kinds:
        for name in kind.symbols:
            env[name] = hints[classes[axis]]
            axis += 1
    try:
        return all(bool(evaluate(env)) for _, evaluate in plan.guards)
    except Exception:  # a size this env lacks: trace to find out
        return False


def _structure(
    plan: Plan | Failure,
    probe: Callable[[], Plan | Failure] | None,
) -> tuple[list[tuple[int, ...]] | None, Plan | Failure | None]:
    """The ragged axes of each output, as f gives them (None when the trace stopped
    before its end), and the probe trace when one ran.

    The first trace's example sizes are large. Where a guard fixed a ragged size
    (``len(t)``, ``float(n)``) or f branches on sizes (``t[:min(3, n)]`` has 3 rows
    for every n >= 3), its fixed output sizes may still follow the input's: a probe
    trace on small sizes tells them apart (axes ragged there, or of other sizes,
    are ragged). The structure depends on f only, never on a batch."""
    specs, pinned, guarded = _specs(plan)
    if specs is None:
        return None, None
    positions = [set(ragged_positions_of(s)) for s in specs]
    if probe is None or not (pinned or guarded):
        return [tuple(sorted(p)) for p in positions], None
    other = probe()
    more, _, _ = _specs(other)
    if more is None or len(more) != len(specs):
        # the probe stopped early: a pinned trace cannot tell; else keep the first's
        return (None if pinned else [tuple(sorted(p)) for p in positions]), other
    for p, a, b in zip(positions, specs, more, strict=True):
        if isinstance(a, TSpec) and isinstance(b, TSpec) and len(a.shape) == len(b.shape):
            p.update(ragged_positions_of(b))
            p.update(q for q, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y)
    return [tuple(sorted(p)) for p in positions], other


def _specs(plan: Plan | Failure) -> tuple[list[Any] | None, bool, bool]:
    if isinstance(plan, Plan):
        return output_specs(plan), plan.pinned, bool(plan.guards)
    return plan.specs, plan.pinned, plan.guarded


def _trace_plan(
    f: Any,
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    classes: tuple[int, ...],
    hints: tuple[int, ...],
    deps: Any,
) -> Plan | Failure:
    try:
        # trace outside any torch.func transform the call runs under
        with torch._C._DisableFuncTorch(), torch.enable_grad():
            return trace(f, leaves, kinds, treespec, classes, hints, deps.lifted_ids)
    except RaggedError:
        raise
    except Exception as error:  # data-dependent control flow, unsupported graph, ...
        first = str(error).splitlines()[0] if str(error) else ""
        reason = f"tracing failed: {type(error).__name__}: {first}"[:500]
        return Failure(
            reason,
            getattr(error, "specs", None),
            getattr(error, "pinned", False),
            getattr(error, "guarded", False),
            getattr(error, "out_spec", None),
        )


@dataclasses.dataclass
class Failure:
    """Why ``f`` could not be traced; ``specs``: the output structure when the trace
    completed but cannot run batched (an in-place write into an argument, ...)."""

    reason: str
    specs: list[Any] | None
    pinned: bool = False
    guarded: bool = False
    out_spec: Any = None


def _lookup(
    f: Any, leaves: list[Any], kinds: list[str], treespec: Any, dims: Any
) -> tuple[Variant, list[Any], _cache.Entry, tuple[int, ...]]:
    classes = size_classes(leaves, kinds)
    static = (dims, str(treespec), signature(leaves, kinds), classes, _cache.global_state())
    roots = _roots(f, leaves, kinds)
    values = [r for r, _ in roots]
    with _LOCK:
        entry = _cache.entry_of(f, create=True)
        assert entry is not None
        found = _cache.find(entry, static, values)
        if found is not None:
            entry.hits += 1
            return found[0], found[1], entry, classes
        entry.traces += 1
        variant, lifted, cacheable = _new_variant(
            f, roots, static, leaves, kinds, treespec, classes
        )
        if cacheable:
            _cache.add(entry, variant)
        else:
            _warn(
                None,
                "f reads "
                + "; ".join(variant.plans[0].unknown)
                + " from a place raggedfn does not follow (not a closure cell, global, "
                "default, argument, or attribute of those): it is traced again at every "
                "call so that it is never stale; pass it as an argument (in_dims=None)",
            )
        return variant, lifted, entry, classes


def _check_randomness(plans: list[Plan], randomness: str) -> None:
    if randomness != "error":
        return
    for plan in plans:
        for step in plan.steps:
            if step.random:
                raise fail("map", f"f calls the random op {step.op} and randomness='error'")


def _map(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    in_dims: Any,
    strict: bool,
    randomness: str,
    report: MapReport | None,
) -> Any:
    if randomness not in _RANDOMNESS:
        raise fail("map", f"randomness must be one of {_RANDOMNESS}, got {randomness!r}")
    if tracing():
        # raggedfn.map inside a function being traced for raggedfn.map: the outer
        # trace fails and the outer call runs per sample, where this call is ordinary
        raise Unsupported("map nested inside a mapped function is not batched")
    dims, leaves, treespec, kinds, batch_size = _prepare("map", args, in_dims)
    if any(k == "ragged" and leaf.row_offsets for leaf, k in zip(leaves, kinds, strict=True)):
        # a nested value's samples are one-level Ragged values: f runs on each of them
        # (its sizes count elements per level, not extents; no trace of them yet)
        reason = "f maps over a nested value (its samples are Ragged values)"
        if torch.compiler.is_compiling():
            raise fail("map", f"{reason}: not supported inside torch.compile")
        return _whole_loop(
            f, args, dims, batch_size, None, reason, strict, randomness, report, None
        )
    if torch.compiler.is_compiling():
        return compiled_map(f, args, leaves, kinds, treespec, dims, batch_size, randomness)
    variant, lifted, entry, classes = _lookup(f, leaves, kinds, treespec, dims)
    if report is not None:
        report.traces = entry.traces
        report.structure = variant.structure
    if variant.failure is not None and batch_size == 0 and variant.empty is not None:
        empty = empty_result(*variant.empty, variant.structure, _device_of(leaves, kinds))
        if empty is not None:
            return empty
    if variant.failure is not None:
        if strict:
            raise fail(
                "map",
                f"f could not be traced ({variant.failure}); strict=True refuses the "
                "per-sample loop",
            )
        return _whole_loop(
            f,
            args,
            dims,
            batch_size,
            variant,
            variant.failure,
            strict,
            randomness,
            report,
            variant.structure,
        )
    _check_randomness(variant.plans, randomness)
    device = _device_of(leaves, kinds)
    plan = variant.plans[0]
    if report is not None:
        report.trace_seconds = sum(p.trace_seconds for p in variant.plans)
        report.guards = [text for p in variant.plans for text, _ in p.guards]
    ctx, inputs = make_ctx(plan, leaves, batch_size, device, lifted, randomness)
    recorder = Recorder() if report is not None else None
    ok = guard_mask(plan, ctx)
    try:
        if ok is None:  # every sample meets the guards: the common case, no split
            out = run(plan, ctx, inputs, strict, recorder)
            if plan.pinned or plan.guards:
                # fixed sizes of a trace under guards become ragged where f's are
                out = _restructure(out, variant, batch_size, device)
        else:
            out = _split(
                f,
                args,
                dims,
                leaves,
                kinds,
                treespec,
                batch_size,
                device,
                variant,
                lifted,
                classes,
                ok,
                strict,
                randomness,
                recorder,
                report,
            )
    except LateGuardFailed as error:
        late: str | None = str(error)
    else:
        late = None
    if late is not None:
        # torch checked a data-dependent size while tracing (a narrow of a nonzero
        # count) and some sample breaks it: the loop gives that sample torch's answer
        return _whole_loop(
            f, args, dims, batch_size, variant, late, strict, randomness, report, variant.structure
        )
    if report is not None and recorder is not None:
        report.batched = dict(recorder.batched)
        report.fallback = dict(recorder.fallback)
        report.unbatched = dict(recorder.unbatched)
    return out


def _whole_loop(
    f: Any,
    args: tuple[Any, ...],
    dims: Any,
    batch_size: int,
    variant: Variant | None,
    reason: str,
    strict: bool,
    randomness: str,
    report: MapReport | None,
    structure: list[tuple[int, ...]] | None,
    warn: bool = True,
) -> Any:
    if strict:
        raise fail("map", f"{reason}; strict=True refuses the per-sample loop")
    if report is not None:
        report.whole_loop = reason
    if warn:
        _warn(variant, f"f runs as a per-sample loop ({reason})")
    return function_loop(f, args, dims, batch_size, structure, randomness)


def _split(
    f: Any,
    args: tuple[Any, ...],
    dims: Any,
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    batch_size: int,
    device: Any,
    variant: Variant,
    lifted: list[Any],
    classes: tuple[int, ...],
    first_ok: torch.Tensor,
    strict: bool,
    randomness: str,
    recorder: Recorder | None,
    report: MapReport | None,
) -> Any:
    """Some samples fail the first plan's guards: group samples by the plan they meet
    (tracing a new plan on a failing sample's sizes, up to ``MAX_PLANS``), run each
    group batched, the rest per sample, and merge the results in sample order."""
    remaining = torch.ones(batch_size, dtype=torch.bool, device=device)
    groups: list[tuple[torch.Tensor, Plan]] = []
    failed_guards: list[str] = []
    index = 0
    while bool(remaining.any()):
        if index < len(variant.plans):
            plan = variant.plans[index]
            ctx, _ = make_ctx(plan, leaves, batch_size, device, lifted, randomness)
            ok = first_ok if index == 0 else guard_mask(plan, ctx)
            mine = remaining if ok is None else remaining & ok
            if ok is not None:
                failed_guards.extend(
                    text for text, evaluate in plan.guards if _fails(evaluate, ctx, remaining)
                )
            if bool(mine.any()):
                groups.append((mine.nonzero().flatten(), plan))
                remaining = remaining & ~mine
            index += 1
            continue
        if len(variant.plans) >= _cache.MAX_PLANS or variant.exhausted is not None:
            break
        # trace again with the sizes of the first sample no plan fits (one with
        # elements first: torch's stride logic can fail on an all-zero example)
        empty = empty_samples(leaves, kinds, batch_size, device)
        waiting = remaining & ~empty
        if not bool(waiting.any()):
            if variant.no_empty_plan:
                break
            waiting = remaining
        sample = int(waiting.nonzero()[0])
        hints = _class_hints(_columns(leaves, kinds), classes, sample)
        with _LOCK:
            new = _trace_plan(f, leaves, kinds, treespec, classes, hints, variant.deps)
        if isinstance(new, Failure) or new.unknown:
            if bool(empty[sample]):
                variant.no_empty_plan = True  # empty samples run per sample (cheap)
                break
            variant.exhausted = (
                new.reason if isinstance(new, Failure) else "unfollowed captured tensors"
            )
            break
        _check_randomness([new], randomness)
        variant.plans.append(new)
    if report is not None:
        report.guards = [text for p in variant.plans for text, _ in p.guards]
    loop_index = remaining.nonzero().flatten() if bool(remaining.any()) else None
    if loop_index is not None:
        reason = "; ".join(sorted(set(failed_guards))) or "no trace fits these sizes"
        reason = f"guard {reason} fails for {loop_index.numel()} sample(s)"
        empty = empty_samples(leaves, kinds, batch_size, device)
        only_empty = bool(empty[loop_index].all())
        if strict and not only_empty:
            raise fail(
                "map",
                f"the trace of f holds only under {reason}; strict=True refuses the per-sample loop",
            )
        if report is not None:
            report.whole_loop = reason if not groups else None
            report.partial_loop = reason
        if not only_empty:  # samples without elements cost nothing per sample
            _warn(variant, f"some samples run per sample ({reason})")
    if not groups:
        return _whole_loop(
            f,
            args,
            dims,
            batch_size,
            variant,
            reason,
            False,  # strict refused above unless every sample is empty
            randomness,
            None,
            variant.structure,
            warn=not only_empty,
        )
    flat_parts: list[list[tuple[torch.Tensor, Any]]] = []
    out_spec = None
    for sample_index, plan in groups:
        sub = [
            take(leaf, sample_index) if kind in ("ragged", "dense") else leaf
            for leaf, kind in zip(leaves, kinds, strict=True)
        ]
        ctx, inputs = make_ctx(plan, sub, int(sample_index.numel()), device, lifted, randomness)
        # strict=True lets samples without elements run per node: they cost nothing,
        # and torch's own code often special-cases them (a plan of their own is pinned)
        only_empty = bool(empty_samples(leaves, kinds, batch_size, device)[sample_index].all())
        out = run(plan, ctx, inputs, strict and not only_empty, recorder)
        flat, spec = pytree.tree_flatten(out, is_leaf=is_ragged_leaf)
        if out_spec is None:
            out_spec = spec
        elif spec != out_spec:
            raise fail(
                "map",
                f"f returns different structures for different samples: {out_spec} and {spec}",
            )
        flat_parts.append([(sample_index, leaf) for leaf in flat])
    if loop_index is not None:
        sub_args = pytree.tree_unflatten(
            [
                take(leaf, loop_index) if kind in ("ragged", "dense") else leaf
                for leaf, kind in zip(leaves, kinds, strict=True)
            ],
            treespec,
        )
        out = function_loop(
            f,
            sub_args,
            dims,
            int(loop_index.numel()),
            variant.structure,
            randomness,
            loop_index.tolist(),
        )
        flat, spec = pytree.tree_flatten(out, is_leaf=is_ragged_leaf)
        if spec != out_spec:
            raise fail(
                "map",
                f"f returns different structures for different samples: {out_spec} and {spec}",
            )
        flat_parts.append([(loop_index, leaf) for leaf in flat])
    columns = list(zip(*flat_parts, strict=True))
    assert out_spec is not None
    # the output structure is the first plan's (traced on sizes unlike any special
    # case), so it does not depend on which samples this batch holds
    shapes = variant.structure or [()] * len(columns)
    if len(shapes) != len(columns):
        shapes = [()] * len(columns)
    return pytree.tree_unflatten(
        [merge(list(col), batch_size, s) for col, s in zip(columns, shapes, strict=True)],
        out_spec,
    )


def _restructure(out: Any, variant: Variant, batch_size: int, device: Any) -> Any:
    flat, spec = pytree.tree_flatten(out, is_leaf=is_ragged_leaf)
    shapes = variant.structure or []
    if len(shapes) != len(flat):
        return out
    every = torch.arange(batch_size, device=device)
    return pytree.tree_unflatten(
        [
            merge([(every, leaf)], batch_size, s) if _needs_merge(leaf, s) else leaf
            for leaf, s in zip(flat, shapes, strict=True)
        ],
        spec,
    )


def _device_of(leaves: list[Any], kinds: list[str]) -> Any:
    return next(
        leaf.values.device if isinstance(leaf, Ragged) else leaf.device
        for leaf, k in zip(leaves, kinds, strict=True)
        if k in ("ragged", "dense")
    )


def _needs_merge(leaf: Any, ragged: tuple[int, ...]) -> bool:
    """Whether a plan's output leaf lacks ragged axes the output structure has."""
    if not ragged:
        return False
    if isinstance(leaf, Ragged):
        return not set(ragged) <= {p for p, a in enumerate(leaf.layout.axes) if a.ragged}
    return True


def _class_hints(
    columns: list[torch.Tensor], classes: tuple[int, ...], sample: int
) -> tuple[int, ...]:
    """Example sizes per size class: those of ``sample``."""
    hints = [0] * len(classes)
    for axis, c in enumerate(classes):
        hints[c] = int(columns[axis][sample])
    return tuple(hints)


def _fails(evaluate: Any, ctx: Any, among: torch.Tensor) -> bool:
    ok = evaluate(ctx.env)
    if isinstance(ok, torch.Tensor):
        return bool((among & ~ok.bool()).any())
    return not ok and bool(among.any())


def map(
    f: Callable[..., Any],
    *args: Any,
    in_dims: Any = 0,
    strict: bool = False,
    randomness: str = "different",
) -> Any:
    """Run the per-sample function ``f`` over a batch, as one batched computation.

    Equals ``[f(*(a[i] if d == 0 else a for a, d in zip(args, in_dims))) for i in range(B)]``
    restacked: per-sample outputs whose shape depends on a ragged size become
    ``Ragged``, fixed-shape outputs a dense ``[B, ...]`` tensor, per-sample
    numbers a ``[B]`` tensor, leaf by leaf. ``f`` is traced once per input
    signature and state of what it reads besides its arguments (module
    ``training`` flags, Python numbers in closures and globals, ...); tensors it
    captures are read afresh at every call. Each traced op runs through a
    batching rule; an op without one runs as a per-sample loop for that node
    (a :class:`RaggedPerformanceWarning` says so; see ``map_report``).

    Args:
        f: a function of per-sample tensors (ordinary torch code).
        *args: ``Ragged`` values and ``[B, ...]`` tensors (mapped) and shared
            values such as parameters (with ``in_dims`` None).
        in_dims: 0 (mapped) or None (shared), one for all or one per argument.
        strict: raise ``RaggedError`` instead of running any per-sample loop (samples
            without elements excepted: they cost nothing, and a guard of torch's own
            code may send them off the batched plan).
        randomness: as in ``torch.func.vmap``: ``"different"`` (random ops draw
            independently for every sample, like the loop), ``"same"`` (one draw
            shared by all samples; refused for ragged shapes) or ``"error"``.

    Returns:
        The outputs of ``f`` for all samples, with ``f``'s pytree structure.

    Raises:
        RaggedError: ``in_dims`` is not 0/None per argument or has the wrong length; no
            argument is mapped; a mapped argument is not a ``Ragged`` or a tensor with a
            batch axis; mapped arguments disagree on the batch size; ``randomness`` is
            not one of the three; ``f`` raises for some sample in the per-sample loop (the
            message names the sample and the original error); ``randomness="error"`` and
            ``f`` draws random numbers; with ``strict=True``, anything would run as a
            per-sample loop.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> w = torch.ones(3, 5)
        >>> y = raggedfn.map(lambda t, w: (t @ w).softmax(0).sum(0), x, w, in_dims=(0, None))
        >>> y.shape
        torch.Size([2, 5])
    """
    return _map(f, args, in_dims, strict, randomness, None)


def map_report(
    f: Callable[..., Any], *args: Any, in_dims: Any = 0, randomness: str = "different"
) -> MapReport:
    """Run ``map(f, *args, in_dims=in_dims)`` and report how each op ran.

    Args:
        f: the per-sample function, as for :func:`map`.
        *args: its arguments, as for :func:`map`.
        in_dims: as for :func:`map`.
        randomness: as for :func:`map`.

    Returns:
        A :class:`MapReport`: ops that ran batched, ops that ran per sample
        (with the reason), guards of the trace, whether the whole function fell
        back to the per-sample loop, and the trace time. ``str(report)`` reads well.
        No :class:`RaggedPerformanceWarning` is emitted: the report says it all.

    Raises:
        RaggedError: as :func:`map`.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> report = raggedfn.map_report(lambda t: t.relu().sum(0), x)
        >>> report.fully_batched
        True
    """
    report = MapReport()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report.output = _map(f, args, in_dims, False, randomness, report)
    return report


def map_cache_info(f: Callable[..., Any]) -> CacheInfo:
    """How many times ``raggedfn.map`` traced ``f`` (or its code), and what it keeps.

    Functions re-created at every call (a lambda inside a loss) share the entry
    of their code; modules and callable objects share the entry of their class.

    Args:
        f: a function (or module, or callable object) given to :func:`map`.

    Returns:
        A :class:`CacheInfo`: ``traces`` (how many times the code was traced),
        ``hits``, ``variants``, ``plans`` and ``evictions``; all zero for a function
        never mapped.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> def f(t):
        ...     return t.sum(0)
        >>> for _ in range(3):
        ...     _ = raggedfn.map(f, x)
        >>> raggedfn.map_cache_info(f).traces
        1
    """
    return _cache.info(f)


__all__ = ["map", "map_cache_info", "map_report"]
