"""Running a batch on a variant's plans: samples grouped by the plan whose guards they
meet (tracing new plans on the sizes of samples none fits), each group batched, the rest
per sample, merged in sample order; and the whole-batch per-sample loop."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..._errors import RaggedPerformanceWarning, fail
from ..._ragged import Ragged
from ..base._random import same_start
from ..base._report import MapReport
from ..base._sizes import Sz
from ..base._steps import Plan, TSpec
from ..running._fallback import function_loop, output_specs
from ..running._interpret import Recorder, guard_mask, make_ctx, run
from ..running._split import empty_samples, merge, take
from ..tracing._signature import size_columns
from ..tracing._trace import LOCK, is_ragged_leaf
from . import _cache
from ._cache import Variant
from ._plans import Failure, hint_env, trace_plan
from ._widen import widen


def warn_once(variant: Variant | None, what: str) -> None:
    if variant is not None:
        if what in variant.warned:
            return
        variant.warned.add(what)
    warnings.warn(f"raggedfn.map: {what}", RaggedPerformanceWarning, stacklevel=4)


def check_randomness(plans: list[Plan], randomness: str) -> None:
    if randomness != "error":
        return
    for plan in plans:
        for step in plan.steps:
            if step.random:
                raise fail("map", f"f calls the random op {step.op} and randomness='error'")


def refuse_unknown_empty(variant: Variant) -> None:
    """On a batch of no samples: raise where the output structure is unknown (``None``: a
    guard fixed a ragged size in the first trace and the probe trace stopped early) and
    some output has a fixed-size axis, which a sample's size may have fixed (``len(t)``
    rows): no sample can tell, and the plan's fixed size is that of one example."""
    if variant.structure is not None or not variant.plans:
        return
    for spec in output_specs(variant.plans[0]):
        if isinstance(spec, TSpec) and any(not isinstance(s, Sz) for s in spec.shape):
            raise fail(
                "map",
                "on a batch of no samples the output structure of f is unknown: its trace "
                "fixed a ragged size (len(t), n == 5, ...) and the trace on small sizes that "
                "would tell which output axes follow the sample sizes stopped early; call "
                "it on a batch with samples",
            )


def whole_loop(
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
        warn_once(variant, f"f runs as a per-sample loop ({reason})")
    return function_loop(f, args, dims, batch_size, structure, randomness)


def run_split(
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
    fresh: torch.Tensor | None = first_ok
    while bool(remaining.any()):
        if index < len(variant.plans):
            plan = variant.plans[index]
            ctx, _ = make_ctx(plan, leaves, batch_size, device, lifted, randomness)
            ok = fresh if index == 0 else guard_mask(plan, ctx)
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
        if traces_of(variant) >= _cache.MAX_PLANS or variant.exhausted is not None:
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
        hints = _class_hints(size_columns(leaves, kinds), classes, sample)
        with LOCK:
            new = trace_plan(f, leaves, kinds, treespec, classes, hints, variant.deps)
        if isinstance(new, Failure) or new.unknown:
            if bool(empty[sample]):
                variant.no_empty_plan = True  # empty samples run per sample (cheap)
                break
            variant.exhausted = (
                new.reason if isinstance(new, Failure) else "unfollowed captured tensors"
            )
            break
        check_randomness([new], randomness)
        if absorb(variant, new, hints, classes):
            # an earlier plan runs these samples too: group every sample again
            remaining = torch.ones(batch_size, dtype=torch.bool, device=device)
            groups, failed_guards, index = [], [], 0
            ctx, _ = make_ctx(variant.plans[0], leaves, batch_size, device, lifted, randomness)
            fresh = guard_mask(variant.plans[0], ctx)
            continue
        variant.plans.append(new)
    if report is not None:
        report.guards = guard_texts(variant.plans)
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
            warn_once(variant, f"some samples run per sample ({reason})")
    if not groups:
        return whole_loop(
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
    # randomness="same": every group (and the loop) starts from the state the first
    # group starts from, so that all samples see one draw
    restart = same_start(randomness, [plan for _, plan in groups])
    for sample_index, plan in groups:
        if restart is not None:
            restart()
        sub = [
            take(leaf, sample_index) if kind in ("ragged", "dense") else leaf
            for leaf, kind in zip(leaves, kinds, strict=True)
        ]
        ctx, inputs = make_ctx(
            plan, sub, int(sample_index.numel()), device, lifted, randomness, meets=True
        )
        # strict=True lets samples without elements run per node: they cost nothing,
        # and torch's own code often special-cases them (a plan of their own is pinned)
        only_empty = bool(empty_samples(leaves, kinds, batch_size, device)[sample_index].all())
        out = run(plan, ctx, inputs, strict and not only_empty, recorder, quiet=only_empty)
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
        if restart is not None:
            restart()
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


def traces_of(variant: Variant) -> int:
    """Plans traced for ``variant``: its plans and the traces absorbed into them."""
    return len(variant.plans) + sum(len(p.alternatives) for p in variant.plans)


def absorb(variant: Variant, new: Plan, hints: tuple[int, ...], classes: tuple[int, ...]) -> bool:
    """Whether an earlier plan of ``variant`` runs the same ops as ``new`` on the samples
    ``new`` was traced for (sizes ``hints`` per size class); then it takes them, under
    ``new``'s guards and those of its own that ``hints`` meet."""
    for plan in variant.plans:
        accepted = widen(plan, new, hint_env(plan, classes, hints))
        if accepted is not None:
            plan.alternatives.append(accepted)
            return True
    return False


def guard_texts(plans: list[Plan]) -> list[str]:
    """The guards of ``plans`` as the report lists them."""
    texts: list[str] = []
    for plan in plans:
        texts.extend(text for text, _ in plan.guards)
        texts.extend(
            "or all of: " + "; ".join(text for text, _ in guards) for guards in plan.alternatives
        )
    return texts


def restructure(out: Any, variant: Variant, batch_size: int, device: Any) -> Any:
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


def device_of(leaves: list[Any], kinds: list[str]) -> Any:
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
