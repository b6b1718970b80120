"""What a trace depends on besides ragged sizes: each flat argument's kind (mapped
ragged value, mapped dense tensor, shared tensor, constant) and the input signature
(layouts, dtypes, fixed sizes, devices, constants' values, objects' types) that picks
a cached plan."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from ..._ragged import Ragged
from ..base._values import axes_of


def size_columns(leaves: list[Any], kinds: list[str]) -> list[torch.Tensor]:
    """``[B]`` sizes of every ragged axis of every mapped input, flattened in order."""
    return [
        leaf.sizes[:, k]
        for leaf, kind in zip(leaves, kinds, strict=True)
        if kind == "ragged"
        for k in range(leaf.num_ragged)
    ]


def leaf_kinds(leaves: list[Any], mapped: list[bool]) -> list[str]:
    kinds = []
    for leaf, m in zip(leaves, mapped, strict=True):
        if m and isinstance(leaf, Ragged):
            kinds.append("ragged")
        elif m and isinstance(leaf, Tensor):
            kinds.append("dense")
        elif isinstance(leaf, Tensor):
            kinds.append("shared")
        else:
            kinds.append("constant")
    return kinds


# the signature entry of a ragged leaf, by (layout code, dtype, dense shape, device): all
# plain hashable values here (map traces eagerly; the compiled path does not come here).
# Bounded: emptied when full (an entry is re-derived at its next miss; clear() is one
# step, safe beside concurrent calls, where dropping the oldest key would iterate)
MAX_RAGGED_SIGNATURES = 256
_RAGGED_SIGNATURES: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def signature(leaves: list[Any], kinds: list[str]) -> tuple[Any, ...]:
    """Everything a trace depends on except ragged sizes (and tensor contents)."""
    out: list[Any] = []
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged":
            v = leaf.values
            key = (leaf.layout.code, v.dtype, v.shape[1:], v.device)
            # (a fake tensor's sizes may be symbolic: not a key)
            found = _RAGGED_SIGNATURES.get(key) if type(v) is Tensor else None
            if found is None:
                axes = tuple((a.ragged, a.index) for a in axes_of(leaf.layout))
                dense = tuple(int(d) for d in v.shape[1:])
                found = ("R", axes, str(v.dtype), dense, str(v.device))
                if type(v) is Tensor:
                    if len(_RAGGED_SIGNATURES) >= MAX_RAGGED_SIGNATURES:
                        _RAGGED_SIGNATURES.clear()
                    _RAGGED_SIGNATURES[key] = found
            out.append(found)
        elif kind == "dense":
            out.append(
                ("D", str(leaf.dtype), tuple(int(d) for d in leaf.shape[1:]), str(leaf.device))
            )
        elif kind == "shared":
            out.append(("S", str(leaf.dtype), tuple(int(d) for d in leaf.shape), str(leaf.device)))
        elif type(leaf) in (bool, int, float, complex, str, bytes, type(None)):
            out.append(("C", type(leaf), leaf))
        else:  # objects: what f reads of them is guarded by the dependency walk
            out.append(("O", type(leaf)))
    return tuple(out)


def size_classes(leaves: list[Any], kinds: list[str]) -> tuple[int, ...]:
    """For every ragged axis of every mapped input: the first axis whose sizes equal its
    own in every sample (one host sync). Equal axes share one symbol in the trace, so
    ``p + p.transpose(0, 1)`` on square pair states, or pair and token inputs of the
    same length, trace without a size mismatch."""
    count = sum(
        leaf.num_ragged for leaf, kind in zip(leaves, kinds, strict=True) if kind == "ragged"
    )
    if count < 2:  # nothing to compare (and no columns to slice out)
        return tuple(range(count))
    columns = size_columns(leaves, kinds)
    if any(isinstance(c, FakeTensor) for c in columns):
        # no data (torch.export traces on fake inputs): no two axes assumed equal
        return tuple(range(count))
    table = torch.stack(columns, 1)
    equal = (table[:, :, None] == table[:, None, :]).all(0).tolist()
    return tuple(row.index(True) for row in equal)
