"""Neural-network layers over trailing dense axes: ``linear``, ``layer_norm``, ``rms_norm``.

Plain torch on ``values`` once the trailing logical dense axes are the trailing
storage axes (in logical order); autograd, ``torch.func`` and ``torch.compile``
see ordinary torch ops, so no custom rule is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .._axes import logical_shape_text
from .._errors import describe, fail, shape_text
from .._layout import Layout
from .._ragged import Ragged, like
from ._shape import trailing_dense

__all__ = ["layer_norm", "linear", "rms_norm"]


def _check_param(fn: str, name: str, x: Ragged, p: Tensor | None, shape: tuple[int, ...]) -> None:
    if p is None:
        return
    if not isinstance(p, Tensor):
        raise fail(fn, f"{name} must be a tensor, got {describe(p)}")
    if tuple(p.shape) != shape:
        raise fail(fn, f"{name} must have shape {shape_text(shape)}, got {describe(p)}")
    if p.dtype != x.dtype:
        raise fail(fn, f"{name} must have the dtype of x ({x.dtype}), got {describe(p)}")
    if p.device != x.device:
        raise fail(fn, f"{name} must be on the device of x ({x.device}), got {describe(p)}")


def linear(x: Ragged, weight: Tensor, bias: Tensor | None = None) -> Ragged:
    """``x @ weight.T + bias`` over the last logical axis, which must be dense.

    Args:
        x: ``Ragged`` of logical shape ``(B, ..., D_in)``.
        weight: ``[D_out, D_in]``, same dtype and device as ``x``.
        bias: optional ``[D_out]``.

    Returns:
        ``Ragged`` of logical shape ``(B, ..., D_out)``, same partition as ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``weight`` is not a ``[D_out, D_in]``
            tensor matching the last (dense) axis; ``bias`` is not a ``[D_out]`` tensor; a
            parameter with another dtype or device than ``x``.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(1, 3)])
        >>> raggedfn.linear(x, torch.ones(4, 3), torch.zeros(4)).shape
        (2, None, 4)
    """
    fn = "linear"
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise fail(fn, f"weight must be a [D_out, D_in] tensor, got {describe(weight)}")
    values, layout = trailing_dense(x, 1, fn)
    _check_param(fn, "weight", x, weight, (weight.shape[0], values.shape[-1]))
    _check_param(fn, "bias", x, bias, (weight.shape[0],))
    return like(x, F.linear(values, weight, bias), layout)


def _normalized(fn: str, x: Ragged, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if isinstance(normalized_shape, torch.Size):
        normalized_shape = tuple(normalized_shape)
    if not isinstance(normalized_shape, Sequence) or not normalized_shape:
        raise fail(
            fn,
            f"normalized_shape must be an int or a non-empty tuple, got {describe(normalized_shape)}",
        )
    if not all(
        isinstance(s, (int, torch.SymInt)) and not isinstance(s, bool) for s in normalized_shape
    ):
        raise fail(fn, f"normalized_shape must hold ints, got {describe(normalized_shape)}")
    return tuple(normalized_shape)


def _norm_values(fn: str, x: Ragged, shape: tuple[int, ...]) -> tuple[Tensor, Layout]:
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    values, layout = trailing_dense(x, len(shape), fn)
    if tuple(values.shape[values.ndim - len(shape) :]) != shape:
        raise fail(
            fn,
            f"normalized_shape {shape_text(shape)} must equal the trailing axes of logical shape "
            f"{logical_shape_text(x)}",
        )
    return values, layout


def layer_norm(
    x: Ragged,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Ragged:
    """Layer normalization over the trailing dense logical axes (``F.layer_norm``).

    Args:
        x: ``Ragged`` whose last ``len(normalized_shape)`` logical axes are dense.
        normalized_shape: sizes of those axes.
        weight: optional ``normalized_shape`` scale.
        bias: optional ``normalized_shape`` shift.
        eps: added to the variance.

    Returns:
        ``Ragged`` with the logical shape and partition of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``normalized_shape`` is not an int or
            a non-empty tuple of ints, or is not the trailing (dense) logical axes of ``x``;
            a parameter of another shape, dtype or device.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.randn(2, 4), torch.randn(3, 4)])
        >>> y = raggedfn.layer_norm(x, 4)
        >>> bool(y.values.mean(-1).abs().max() < 1e-5)
        True
    """
    fn = "layer_norm"
    shape = _normalized(fn, x, normalized_shape)
    values, layout = _norm_values(fn, x, shape)
    _check_param(fn, "weight", x, weight, shape)
    _check_param(fn, "bias", x, bias, shape)
    out = F.layer_norm(values, shape, weight, bias, eps)
    return like(x, out, layout)


def rms_norm(
    x: Ragged,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Ragged:
    """RMS normalization over the trailing dense logical axes (``F.rms_norm``).

    Args:
        x: ``Ragged`` whose last ``len(normalized_shape)`` logical axes are dense.
        normalized_shape: sizes of those axes.
        weight: optional ``normalized_shape`` scale.
        eps: added to the mean square (None: ``torch.finfo(dtype).eps``, like torch).

    Returns:
        ``Ragged`` with the logical shape and partition of ``x``.

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value; ``normalized_shape`` is not an int or
            a non-empty tuple of ints, or is not the trailing (dense) logical axes of ``x``;
            a parameter of another shape, dtype or device.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.full((2, 4), 3.0)])
        >>> raggedfn.rms_norm(x, (4,)).values[0].tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    fn = "rms_norm"
    shape = _normalized(fn, x, normalized_shape)
    values, layout = _norm_values(fn, x, shape)
    _check_param(fn, "weight", x, weight, shape)
    out = F.rms_norm(values, shape, weight, eps)
    return like(x, out, layout)
