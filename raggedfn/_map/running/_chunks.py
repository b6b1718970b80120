"""Running a plan over groups of consecutive samples whose intermediates stay cache-sized.

A per-sample function that builds a pair state ``[N, N, C]`` and a ``4C`` hidden layer
on it makes packed intermediates of ``sum N_i^2 x 4C`` floats: tens of MB for a batch,
which fall out of the CPU caches (and, freshly allocated, page-fault) between one op
and the next, while the per-sample loop's blocks stay in cache. ``map`` therefore runs
its plan on groups of consecutive samples whose largest intermediate holds at most
``chunk_elements`` elements, and joins the groups' outputs in sample order (a
``cat``, so gradients flow through as usual). One group, the common case for token
batches, runs exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..._errors import describe, fail
from ..._index import offsets_of
from ..._ragged import Ragged
from ..base._sizes import Sz
from ..base._steps import Plan, TSpec

# elements of a group's largest intermediate. Row tiles (_tiles.py) keep the widest
# intermediates in cache whatever the group, and on pair states (C = 32, 1 thread,
# benchmarks/pair_state.py) groups of 1M elements on top of them ran slower than one
# group (the plan's per-run overhead, once per group): groups are for batches whose
# untiled intermediates alone are large (16M elements: 64 MiB of float32).
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def check_chunk_elements(value: Any) -> int:
    """``chunk_elements`` as given to ``map``: ``None`` (the default budget), 0 (no
    grouping) or a positive element count."""
    if value is None:
        return DEFAULT_CHUNK_ELEMENTS
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail("map", f"chunk_elements must be None or an int >= 0, got {describe(value)}")
    return value


def _spec_costs(plan: Plan) -> list[tuple[list[Sz], int]]:
    """Per ragged step output: its ragged sizes and the product of its fixed sizes."""
    cached = getattr(plan, "_chunk_costs", None)
    if cached is not None:
        return cached
    # one entry per distinct set of ragged sizes (a BERT layer has two or three), so
    # that a call evaluates a handful of size expressions, not one per node
    found: dict[tuple[str, ...], tuple[list[Sz], int]] = {}
    for step in plan.steps:
        for spec in step.out if isinstance(step.out, tuple) else (step.out,):
            if isinstance(spec, TSpec) and spec.ragged:
                ragged = [s for s in spec.shape if isinstance(s, Sz)]
                fixed = math.prod(int(s) for s in spec.shape if not isinstance(s, Sz))
                key = tuple(sorted(s.key for s in ragged))
                if key not in found or found[key][1] < fixed:
                    found[key] = (ragged, fixed)
    costs = list(found.values())
    plan._chunk_costs = costs  # type: ignore[attr-defined]
    return costs


def within_budget(plan: Plan, leaves: list[Any], batch_size: int, budget: int) -> bool:
    """Whether the batch surely fits one group, from host-side sizes only (no tensor op,
    no sync: small calls pay nothing for grouping): ``sum_i prod_j s_ji <= prod_j
    sum_i s_ji``, and a token input's ``sum_i s_i`` is its row count."""
    totals: dict[str, int] = {}
    for i in plan.placeholders:
        kind = plan.leaf_kinds[i]
        if kind.kind == "ragged" and len(kind.symbols) == 1:
            totals[kind.symbols[0]] = int(leaves[i].values.shape[0])
    for ragged, fixed in _spec_costs(plan):
        bound = fixed
        for s in ragged:
            if s.const is not None:
                bound *= max(s.const, 0) * batch_size
            elif s.key in totals:
                bound *= totals[s.key]
            else:
                return False
        if bound > budget:
            return False
    return True


def sample_costs(plan: Plan, env: dict[str, Tensor], batch_size: int) -> Tensor | None:
    """``[B]`` int64: the elements of each sample's largest ragged intermediate, or
    ``None`` when the plan has none (nothing grows with the sizes)."""
    out: Tensor | None = None
    for ragged, fixed in _spec_costs(plan):
        count: Any = fixed
        try:
            for s in ragged:
                value = s.fn(env)
                count = count * (value.clamp(min=0) if isinstance(value, Tensor) else max(value, 0))
        except KeyError:
            continue  # a data-dependent size (a mask's count): known only once it has run
        if not isinstance(count, Tensor):
            continue  # no size of a sample (a constant-size axis): the same for all
        out = count if out is None else torch.maximum(out, count)
    if out is None:
        return None
    return out.to(torch.int64).expand(batch_size)


def group_bounds(costs: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` sample ranges, each within ``budget`` elements
    (a single sample over the budget is a group of its own)."""
    bounds: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, cost in enumerate(costs):
        if i > start and cost > 0 and total + cost > budget:
            bounds.append((start, i))
            start, total = i, 0
        total += cost
    if costs:
        bounds.append((start, len(costs)))
    return bounds


def slice_leaves(
    leaves: list[Any], kinds: list[str], row_offsets: list[list[int] | None], start: int, stop: int
) -> list[Any]:
    """Samples ``start:stop`` of every mapped leaf (views of the packed values)."""
    out: list[Any] = []
    for leaf, kind, rows in zip(leaves, kinds, row_offsets, strict=True):
        if kind == "ragged":
            assert rows is not None
            out.append(
                Ragged._make(
                    leaf.values[rows[start] : rows[stop]],
                    leaf.offsets[start : stop + 1] - rows[start],
                    leaf.sizes[start:stop],
                    leaf.layout,
                )
            )
        elif kind == "dense":
            out.append(leaf[start:stop])
        else:
            out.append(leaf)
    return out


def _join(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, Ragged):
        if any(p.layout != first.layout for p in parts):
            raise fail("map", "groups of samples gave outputs of different layouts")
        lengths = torch.cat([p.offsets[1:] - p.offsets[:-1] for p in parts])
        return Ragged._make(
            torch.cat([p.values for p in parts]),
            offsets_of(lengths),
            torch.cat([p.sizes for p in parts]),
            first.layout,
        )
    if isinstance(first, Tensor):
        return torch.cat(parts)
    return first


def run_in_groups(
    bounds: list[tuple[int, int]],
    run_group: Callable[[int, int], Any],
) -> Any:
    """Run ``run_group(start, stop)`` for every group and join the outputs leaf by leaf."""
    outs = [run_group(start, stop) for start, stop in bounds]
    flat = [pytree.tree_flatten(o, is_leaf=lambda v: isinstance(v, Ragged)) for o in outs]
    spec = flat[0][1]
    leaves = [_join([f[0][i] for f in flat]) for i in range(len(flat[0][0]))]
    return pytree.tree_unflatten(leaves, spec)


__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "check_chunk_elements",
    "group_bounds",
    "run_in_groups",
    "sample_costs",
    "slice_leaves",
    "within_budget",
]
