"""Running a plan on the whole batch or on groups of samples within a budget.

Shared by the general path (``_api``) and the warm call (``_warm``); the grouping
itself (costs, bounds, slicing, joining) is in :mod:`._chunks`.
"""

from __future__ import annotations

from typing import Any

from ..base._random import same_start
from ._chunks import group_bounds, run_in_groups, sample_costs, slice_leaves, within_budget
from ._interpret import Recorder, make_ctx, run


def run_chunked(
    plan: Any,
    ctx: Any,
    inputs: list[Any],
    leaves: list[Any],
    kinds: list[str],
    lifted: list[Any],
    budget: int,
    strict: bool,
    randomness: str,
    recorder: Recorder | None,
) -> Any:
    """``run`` on the whole batch, or on groups of consecutive samples whose largest
    intermediate stays within ``budget`` elements (see :mod:`._chunks`)."""
    bounds = None
    ctx.tiles = budget > 0
    if budget and ctx.batch_size > 1 and not within_budget(plan, leaves, ctx.batch_size, budget):
        costs = sample_costs(plan, ctx.env, ctx.batch_size)
        if costs is not None:
            per_sample = costs.tolist()  # one host sync
            if sum(per_sample) > budget:
                bounds = group_bounds(per_sample, budget)
    if bounds is None or len(bounds) == 1:
        return run(plan, ctx, inputs, strict, recorder)
    rows = [
        leaf.offsets.tolist() if k == "ragged" else None
        for leaf, k in zip(leaves, kinds, strict=True)
    ]
    restart = same_start(randomness, [plan])  # every group draws what the first does

    def run_group(start: int, stop: int) -> Any:
        if restart is not None:
            restart()
        part = slice_leaves(leaves, kinds, rows, start, stop)
        group_ctx, group_inputs = make_ctx(plan, part, stop - start, ctx.device, lifted, randomness)
        group_ctx.tiles = True
        return run(plan, group_ctx, group_inputs, strict, recorder)

    return run_in_groups(bounds, run_group)


__all__ = ["run_chunked"]
