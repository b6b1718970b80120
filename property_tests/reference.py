"""Per-sample loop references: the independent side of every equivalence test.

Nothing here calls raggedfn's conversions (``unbind``, ``to_padded``, ...): the
per-sample tensors are cut out of the packed storage by plain Python loops, so
a bug in a conversion cannot hide the same bug in the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from raggedfn import Ragged


def samples(x: Ragged) -> list[Tensor]:
    """Sample ``i`` of ``x`` in logical axis order, by hand."""
    offsets = [int(v) for v in x.offsets.tolist()]
    sizes = [[int(s) for s in row] for row in x.sizes.tolist()]
    dense = list(x.values.shape[1:])
    num_ragged = x.layout.num_ragged
    out = []
    for i in range(len(offsets) - 1):
        block = x.values[offsets[i] : offsets[i + 1]].reshape(*sizes[i], *dense)
        perm = [a.index if a.ragged else num_ragged + a.index for a in x.layout.axes]
        out.append(block.permute(*perm))
    return out


def loop(fn: Callable[..., Any], *xs: Any) -> list[Any]:
    """``[fn(x_0[i], x_1[i], ...) for i in range(B)]``; non-Ragged args are shared."""
    per_arg = [samples(x) if isinstance(x, Ragged) else None for x in xs]
    batch = next(len(p) for p in per_arg if p is not None)
    return [
        fn(*(p[i] if p is not None else x for p, x in zip(per_arg, xs, strict=True)))
        for i in range(batch)
    ]


def assert_same(result: Any, expected: Sequence[Tensor], **tolerances: Any) -> None:
    """``result`` (a Ragged or a dense ``[B, ...]`` tensor) equals the per-sample list."""
    if isinstance(result, Ragged):
        got = samples(result)
    else:
        assert isinstance(result, Tensor), f"expected a Ragged or a tensor, got {type(result)}"
        assert result.shape[0] == len(expected), (result.shape, len(expected))
        got = list(result.unbind(0))
    assert len(got) == len(expected), f"batch sizes differ: {len(got)} vs {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.shape == e.shape, (
            f"sample {i}: shape {tuple(g.shape)} != expected {tuple(e.shape)}"
        )
        torch.testing.assert_close(
            g, e, equal_nan=True, msg=lambda m, i=i: f"sample {i}: {m}", **tolerances
        )


def pack_like(tensors: Sequence[Tensor], x: Ragged) -> Tensor:
    """Packed ``values`` of per-sample tensors laid out like ``x`` (for grads)."""
    num_ragged = x.layout.num_ragged
    perm = [a.index if a.ragged else num_ragged + a.index for a in x.layout.axes]
    inverse = [0] * len(perm)
    for logical, physical in enumerate(perm):
        inverse[physical] = logical
    dense = x.values.shape[1:]
    parts = [t.permute(*inverse).reshape(-1, *dense) for t in tensors]
    if not parts:
        return x.values.new_zeros(x.values.shape)
    return torch.cat(parts)


def pad_by_hand(
    tokens: Sequence[Tensor], side: str, length: int, fill: float = 0
) -> tuple[Tensor, Tensor]:
    """``(padded [B, length, ...], int64 0/1 mask [B, length])`` padded on ``side``, by hand."""
    rows, masks = [], []
    for t in tokens:
        pad = length - t.shape[0]
        filler = torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype)
        rows.append(torch.cat([filler, t] if side == "left" else [t, filler]))
        ones, zeros = torch.ones(t.shape[0], dtype=torch.int64), torch.zeros(pad, dtype=torch.int64)
        masks.append(torch.cat([zeros, ones] if side == "left" else [ones, zeros]))
    return torch.stack(rows), torch.stack(masks)
