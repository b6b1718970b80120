"""Conversions for varlen attention kernels (``cu_seqlens``) and ``torch.nested``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._construct import from_offsets
from ._errors import describe, fail, shape_text
from ._padded import max_sizes
from ._ragged import Ragged


def _require_tokens(fn: str, x: Ragged) -> None:
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    if x.num_ragged != 1 or not x.layout.axes[0].ragged:
        raise fail(
            fn,
            f"needs one ragged axis at logical axis 1, got logical shape {shape_text(x.shape)} "
            f"(ragged axes {x.ragged_dims})",
        )


def _dense_in_order(x: Ragged) -> Tensor:
    """``values`` with the dense axes in logical order (a copy only when needed)."""
    perm = [a.index for a in x.layout.axes if not a.ragged]
    if perm == sorted(perm):
        return x.values
    return x.values.permute(0, *(1 + j for j in perm))


def cu_seqlens(x: Ragged) -> tuple[Tensor, int]:
    """``(int32 [B + 1] cumulative lengths, max length)`` as varlen attention kernels take them.

    Args:
        x: a value of logical shape ``(B, N*, ...)``.

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 ``[B + 1]`` offsets and the largest length (a Python int, one host sync).

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value, or it does not have exactly one ragged
            axis at logical axis 1.

    Examples:
        >>> import torch, raggedfn
        >>> raggedfn.cu_seqlens(raggedfn.from_lengths(torch.zeros(5), [2, 3]))
        (tensor([0, 2, 5], dtype=torch.int32), 3)
    """
    _require_tokens("cu_seqlens", x)
    return x.offsets.to(torch.int32), max_sizes(x)[0]


def to_nested(x: Ragged) -> Tensor:
    """A ``torch.nested`` jagged tensor sharing ``values`` (one ragged axis at axis 1).

    The min/max sequence lengths are passed so torch never pads to the total length.

    Args:
        x: a value of logical shape ``(B, N*, ...)`` with ``B >= 1``.

    Returns:
        A jagged nested tensor of shape ``(B, j, ...)`` whose ``values()`` is ``x.values``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; it does not have exactly one ragged
            axis at logical axis 1; the batch is empty (``B = 0``).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.zeros(5, 2), [2, 3])
        >>> njt = raggedfn.to_nested(x)
        >>> njt.is_nested, njt.values().data_ptr() == x.values.data_ptr()
        (True, True)
    """
    _require_tokens("to_nested", x)
    if x.batch_size == 0:
        raise fail("to_nested", "torch.nested cannot hold an empty batch (B = 0)")
    lengths = x.lengths
    return torch.nested.nested_tensor_from_jagged(
        _dense_in_order(x),
        x.offsets.clone(),  # the nested tensor must not share (and so could edit) our partition
        min_seqlen=int(lengths.min()),
        max_seqlen=int(lengths.max()),
    )


def from_nested(njt: Tensor) -> Ragged:
    """A ``Ragged`` sharing the packed values of a ``torch.nested`` jagged tensor.

    Args:
        njt: a ``layout=torch.jagged`` nested tensor ragged along axis 1, without holes.

    Returns:
        ``Ragged`` of logical shape ``(B, N*, ...)`` with ``values`` = ``njt.values()``.

    Raises:
        RaggedError: ``njt`` is not a ``torch.jagged`` nested tensor, is ragged along
            another axis than 1, or has holes (``lengths`` besides ``offsets``).

    Examples:
        >>> import torch, raggedfn
        >>> njt = torch.nested.nested_tensor_from_jagged(torch.zeros(5, 2), torch.tensor([0, 2, 5]))
        >>> raggedfn.from_nested(njt).lengths.tolist()
        [2, 3]
    """
    fn = "from_nested"
    if not isinstance(njt, Tensor) or not njt.is_nested or njt.layout != torch.jagged:
        got = (
            f"a nested tensor with layout {njt.layout}"
            if isinstance(njt, Tensor) and njt.is_nested
            else describe(njt)
        )
        raise fail(fn, f"njt must be a torch.nested tensor with layout=torch.jagged, got {got}")
    nested: Any = njt  # NestedTensor's jagged API is not in Tensor's type stubs
    if getattr(nested, "_ragged_idx", 1) != 1:
        raise fail(
            fn,
            f"only a jagged tensor ragged along axis 1 is supported, got ragged axis {nested._ragged_idx}",
        )
    if nested.lengths() is not None:
        raise fail(
            fn, "jagged tensors with holes (lengths given besides offsets) are not supported"
        )
    return from_offsets(nested.values(), nested.offsets())
