"""Per-sample loops: for one graph node without a batching rule, or for a whole function.

Both are correct and slow (a Python loop with host syncs); ``map_report`` lists
every use, a :class:`~raggedfn.RaggedPerformanceWarning` announces the first of
each kind, and ``strict=True`` refuses them. The whole-function loop passes
every sample as a copy, so ``f`` writing into its argument never reaches the
caller's packed values, and an exception ``f`` raises for a sample reaches the
caller unchanged (its own type, ``except KeyError`` catches it) with a note naming
the sample.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..._construct import from_list
from ..._errors import fail
from ..._ragged import Ragged
from ..base._random import rng_state, set_rng_state
from ..base._sizes import Sz, is_unbacked
from ..base._steps import Plan, TSpec
from ..base._values import Ctx, DenseB, RaggedB, SymB, canonical_layout, make_ragged
from ..tracing._trace import specs_of


def sample_of(ctx: Ctx, value: Any, i: int) -> Any:
    """Sample ``i`` of a batched interpreter value as an ordinary tensor (host sync)."""
    if isinstance(value, DenseB):
        return value.data[i]
    if isinstance(value, SymB):  # a size, or a number read from the data (``.item()``)
        number = ctx.eval(value.sz)[i]
        return float(number) if number.is_floating_point() else int(number)
    if isinstance(value, RaggedB):
        start, stop = (int(v) for v in value.struct.offsets[i : i + 2].tolist())
        sizes = [int(s) for s in value.struct.sizes[i].tolist()]
        block = value.values[start:stop].reshape(*sizes, *value.values.shape[1:])
        return block.permute(value.layout.physical_to_logical())
    if isinstance(value, (list, tuple)):
        return type(value)(sample_of(ctx, v, i) for v in value)
    return value


def _define(ctx: Ctx, sz: Any, column: list[Any]) -> None:
    """A data-dependent size or number (an unbacked symbol) learns its per-sample values."""
    if isinstance(sz, Sz) and is_unbacked(sz.key):
        floats = sz.key.startswith("zuf")
        ctx.env[sz.key] = torch.tensor(
            [float(v) if floats else int(v) for v in column],
            dtype=torch.float64 if floats else torch.int64,
            device=ctx.device,
        )
    elif isinstance(sz, Sz) and (match := _BOOL_ITEM.fullmatch(sz.key)) is not None:
        # a bool read from the data (``.item()`` of a bool tensor): torch's Eq(u, 1)
        ctx.env[match.group(1)] = torch.tensor(
            [int(bool(v)) for v in column], dtype=torch.int64, device=ctx.device
        )


_BOOL_ITEM = re.compile(r"Eq\((u\d+), 1\)")


def restack(ctx: Ctx, outs: list[Any], spec: Any, defines: tuple[str, ...] = ()) -> Any:
    """Per-sample results of one node packed as the batched value its traced spec says."""
    if isinstance(spec, tuple):
        return tuple(restack(ctx, [o[j] for o in outs], s, defines) for j, s in enumerate(spec))
    if isinstance(spec, Sz):
        if defines:
            _define(ctx, spec, list(outs))
        return SymB(spec)
    if not isinstance(spec, TSpec):
        if outs and all(o == outs[0] for o in outs):
            return outs[0]
        return DenseB(torch.tensor(outs, device=ctx.device))
    if not spec.ragged:
        if not outs:
            return DenseB(torch.empty(0, *spec.shape, dtype=spec.dtype, device=ctx.device))
        return DenseB(torch.stack(outs))
    positions = tuple(p for p, s in enumerate(spec.shape) if isinstance(s, Sz))
    if defines:
        for p in positions:
            _define(ctx, spec.shape[p], [int(o.shape[p]) for o in outs])
    layout = canonical_layout(len(spec.shape), positions)
    dense = [s for s in spec.shape if not isinstance(s, Sz)]
    to_physical = layout.logical_to_physical()
    parts = [
        o.permute(to_physical).reshape(math.prod(o.shape[p] for p in positions), *dense)
        for o in outs
    ]
    if parts:
        values = torch.cat(parts)
    else:
        values = torch.empty(0, *dense, dtype=spec.dtype, device=ctx.device)
    out = make_ragged(ctx, values, spec.shape, layout)
    if out.struct.total != values.shape[0]:  # the traced sizes disagree with the samples
        raise fail("map", "a per-sample loop produced sizes that differ from the trace")
    return out


@contextlib.contextmanager
def _rng(randomness: str) -> Iterator[Callable[[], None]]:
    """``next_sample()`` before each sample: the same draws for every sample under
    ``"same"``, a ``RaggedError`` on any random op under ``"error"``."""
    if randomness == "error":
        with _RefuseRandom():
            yield lambda: None
        return
    if randomness == "same":
        state = rng_state()
        yield lambda: set_rng_state(state)
        return
    yield lambda: None


class _RefuseRandom(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise fail("map", f"f calls the random op {func} and randomness='error'")
        return func(*args, **(kwargs or {}))


def node_loop(ctx: Ctx, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    outs = []
    with _rng(ctx.randomness) as next_sample:
        for i in range(ctx.batch_size):
            a = sample_of(ctx, args, i)
            k = {key: sample_of(ctx, v, i) for key, v in kwargs.items()}
            next_sample()
            outs.append(step.target(*a, **k))
    return restack(ctx, outs, step.out, step.defines)


def function_loop(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    in_dims: tuple[Any, ...],
    batch_size: int,
    structure: list[tuple[int, ...]] | None = None,
    randomness: str = "different",
    names: list[int] | None = None,
) -> Any:
    """``[fn(*sample_i) for i]`` restacked, each sample a copy of the caller's data.

    ``names`` are the samples' indices in the caller's batch (for error messages)
    when ``args`` hold only some of its samples.

    ``specs`` (the traced outputs, when a trace exists) say which axes are ragged,
    so the result has the same structure as a batched run. Without them (``f``
    could not be traced), an output axis is ragged when its size differs between
    samples or equals, in every sample, one of that sample's input ragged sizes
    (so ``t * 2`` is ragged even on a batch of equal lengths).
    """

    def pick(a: Any, i: int) -> Any:
        return pytree.tree_map(
            lambda leaf: leaf[i].clone(), a, is_leaf=lambda v: isinstance(v, Ragged)
        )

    results = []
    with _rng(randomness) as next_sample:
        for i in range(batch_size):
            sample = [pick(a, i) if d == 0 else a for a, d in zip(args, in_dims, strict=True)]
            next_sample()
            try:
                results.append(fn(*sample))
            except Exception as error:
                # f's own exception, as the loop and torch.func.vmap raise it (an
                # ``except KeyError`` in the caller catches it), with the sample named
                error.add_note(
                    f"raggedfn.map: raised by f for sample {i if names is None else names[i]}"
                )
                raise
    if not results:
        raise fail(
            "map",
            "f could not be traced and the batch is empty, so the output structure is unknown",
        )
    flat = [pytree.tree_flatten(r, is_leaf=lambda v: isinstance(v, Ragged)) for r in results]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat):
        if other != spec:
            raise fail("map", f"f returns a different structure for sample {i}: {other} vs {spec}")
    columns = list(zip(*(leaves for leaves, _ in flat), strict=True))
    shapes: list[tuple[int, ...] | None] = list(structure or [])
    if len(shapes) != len(columns):
        shapes = [None] * len(columns)
    sizes = _input_sizes(args, in_dims, batch_size)
    packed = [_stack_column(list(col), s, sizes) for col, s in zip(columns, shapes, strict=True)]
    return pytree.tree_unflatten(packed, spec)


def _input_sizes(
    args: tuple[Any, ...], in_dims: tuple[Any, ...], batch_size: int
) -> list[set[int]]:
    """Each sample's ragged input sizes (for the structure of untraced outputs)."""
    sizes: list[set[int]] = [set() for _ in range(batch_size)]
    for a, d in zip(args, in_dims, strict=True):
        if d != 0:
            continue
        for leaf in pytree.tree_leaves(a, is_leaf=lambda v: isinstance(v, Ragged)):
            if isinstance(leaf, Ragged):
                for i, row in enumerate(leaf.sizes.tolist()):
                    sizes[i].update(row)
    return sizes


def _stack_column(
    col: list[Any], positions: tuple[int, ...] | None, input_sizes: list[set[int]]
) -> Any:
    if all(isinstance(c, Ragged) for c in col):
        return from_list(col)  # per-sample Ragged values: one nested level more
    if not all(isinstance(c, Tensor) for c in col):
        if all(isinstance(c, (bool, int, float, complex)) for c in col):
            return torch.tensor(col)
        if all(c == col[0] for c in col):
            return col[0]
        return col
    ranks = {c.ndim for c in col}
    if positions is not None and len(ranks) == 1 and all(p < col[0].ndim for p in positions):
        # f's traced structure, plus the axes whose sizes differ between these samples
        rank = col[0].ndim
        ragged = set(positions) | {a for a in range(rank) if len({c.shape[a] for c in col}) > 1}
        if not ragged:
            return torch.stack(col)
        return from_list(col, ragged_dims=tuple(1 + a for a in sorted(ragged)))
    if len(ranks) != 1:
        raise fail(
            "map", f"f returns tensors of different ranks for different samples: {sorted(ranks)}"
        )
    rank = col[0].ndim
    varying = tuple(
        1 + a
        for a in range(rank)
        if len({c.shape[a] for c in col}) > 1
        or (
            any(input_sizes) and all(c.shape[a] in s for c, s in zip(col, input_sizes, strict=True))
        )
    )
    if not varying:
        return torch.stack(col)
    return from_list(col, ragged_dims=varying)


def to_output(ctx: Ctx, value: Any) -> Any:
    """An interpreter value as the user-facing result."""
    if type(value) is RaggedB:
        values, struct, layout = value.values, value.struct, value.layout
        if (
            type(values) is Tensor
            and not torch.compiler.is_compiling()
            and values.ndim - 1 == layout.num_dense
            and struct.sizes.shape[1] == layout.num_ragged
            and values.device == struct.offsets.device
        ):
            # the checks of Ragged() that a rule could break (offsets and sizes are an
            # input's or built from its sizes, int64 on its device): the rest hold
            return Ragged._make(values, struct.offsets, struct.sizes, layout)
        return Ragged(values, struct.offsets, struct.sizes, layout)
    if isinstance(value, DenseB):
        return value.data
    if isinstance(value, SymB):
        return ctx.eval(value.sz)
    if isinstance(value, Tensor):
        return value.unsqueeze(0).expand(ctx.batch_size, *value.shape)
    if isinstance(value, (bool, int, float, complex)):
        # a per-sample number that happens to be the same for every sample: [B] as well
        return torch.tensor([value] * ctx.batch_size, device=ctx.device)
    return value


def output_specs(plan: Plan) -> list[Any]:
    """The traced spec of every flat output (None for constants and inputs)."""
    return specs_of(plan.steps, plan.outputs, plan.inputs)


__all__ = ["function_loop", "node_loop", "output_specs", "restack", "sample_of", "to_output"]
