"""Elementwise ops on ``Ragged`` values: arithmetic, ``where``, ``apply``.

Operands may be ``Ragged`` values, Python numbers, 0-d tensors or dense tensors
that broadcast against the logical shape ``(B, ...)`` from the right: ``[D]``
per feature, ``[B, 1, D]`` per sample (size-1 axes broadcast along ragged axes).

Two ``Ragged`` operands combine when they have the same partition: the same
offsets/sizes objects cost nothing; equal-valued ones are compared once
(eagerly: a host sync and ``RaggedError`` on mismatch; while compiling: a
runtime assertion). Different dim orders are fine: the second operand is
permuted to the first one's storage. A size-1 axis against a ragged axis
broadcasts and creates that ragged axis (see ``raggedfn.ops._broadcast``).
Comparisons combine their operands the same way (``_compare``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._errors import describe, fail, shape_text
from .._layout import Axis, Layout
from .._ragged import Ragged, like
from ._broadcast import align, same_row_offsets
from ._shape import dense_in_logical_order, reorder_dense

__all__ = [
    "abs",
    "add",
    "apply",
    "div",
    "floor_divide",
    "mul",
    "neg",
    "pow",
    "sub",
    "where",
]


def _binary(fn: str, op: Callable[[Any, Any], Any], x: Any, y: Any) -> Any:
    if not isinstance(x, Ragged) and not isinstance(y, Ragged):
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            return op(x, y)
        raise fail(fn, f"needs a Ragged or tensor operand, got {describe(x)} and {describe(y)}")
    # fast paths (no alignment needed): a number, or the same partition and storage
    if isinstance(x, Ragged) and isinstance(y, (int, float, bool)):
        return like(x, op(x.values, y))
    if isinstance(y, Ragged) and isinstance(x, (int, float, bool)):
        return like(y, op(x, y.values))
    if (
        isinstance(x, Ragged)
        and isinstance(y, Ragged)
        and x.offsets is y.offsets
        and x.sizes is y.sizes
        and x.layout == y.layout
        and x.values.shape == y.values.shape
        and same_row_offsets(x, y)
    ):
        return like(x, op(x.values, y.values))
    (a, b), partition = align(fn, [x, y])
    return partition.build(op(a, b))


def _unary(fn: str, op: Callable[[Tensor], Tensor], x: Any) -> Any:
    if isinstance(x, Tensor):
        return op(x)
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value or a tensor, got {describe(x)}")
    return like(x, op(x.values))


def add(x: Any, y: Any) -> Any:
    """``x + y`` elementwise (see the module docstring for operands).

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors (one ``Ragged`` at least).
        y: the other operand, like ``x``.

    Returns:
        ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(1, 3)])
        >>> raggedfn.add(x, torch.arange(3.0)).values.tolist()
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    """
    return _binary("add", operator.add, x, y)


def sub(x: Any, y: Any) -> Any:
    """``x - y`` elementwise.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.tensor([1.0, 2.0, 3.0]), [1, 2])
        >>> (2 - x).values.tolist()
        [1.0, 0.0, -1.0]
    """
    return _binary("sub", operator.sub, x, y)


def mul(x: Any, y: Any) -> Any:
    """``x * y`` elementwise.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.tensor([1.0, 2.0, 3.0]), [1, 2])
        >>> raggedfn.mul(x, torch.tensor([[10.0], [100.0]])).values.tolist()
        [10.0, 200.0, 300.0]
    """
    return _binary("mul", operator.mul, x, y)


def div(x: Any, y: Any) -> Any:
    """``x / y`` elementwise (true division).

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1.0, 2.0]), [2]) / 2).values.tolist()
        [0.5, 1.0]
    """
    return _binary("div", operator.truediv, x, y)


def pow(x: Any, y: Any) -> Any:
    """``x ** y`` elementwise.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1.0, 3.0]), [2]) ** 2).values.tolist()
        [1.0, 9.0]
    """
    return _binary("pow", operator.pow, x, y)


def floor_divide(x: Any, y: Any) -> Any:
    """``x // y`` elementwise (rounds toward negative infinity, like torch).

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([7, -7]), [2]) // 2).values.tolist()
        [3, -4]
    """
    return _binary("floor_divide", operator.floordiv, x, y)


def neg(x: Any) -> Any:
    """``-x`` elementwise.

    Args:
        x: a ``Ragged`` value (or a tensor: then plain torch).

    Returns:
        ``Ragged`` with the partition of ``x``.

    Raises:
        RaggedError: ``x`` is neither a ``Ragged`` value nor a tensor.

    Examples:
        >>> import torch, raggedfn
        >>> (-raggedfn.from_lengths(torch.tensor([1.0, -2.0]), [2])).values.tolist()
        [-1.0, 2.0]
    """
    return _unary("neg", torch.neg, x)


def abs(x: Any) -> Any:
    """``|x|`` elementwise.

    Args:
        x: a ``Ragged`` value (or a tensor: then plain torch).

    Returns:
        ``Ragged`` with the partition of ``x``.

    Raises:
        RaggedError: ``x`` is neither a ``Ragged`` value nor a tensor.

    Examples:
        >>> import torch, raggedfn
        >>> raggedfn.abs(raggedfn.from_lengths(torch.tensor([1.0, -2.0]), [2])).values.tolist()
        [1.0, 2.0]
    """
    return _unary("abs", torch.abs, x)


def where(condition: Any, x: Any, y: Any) -> Ragged:
    """``x`` where ``condition`` holds, else ``y``, elementwise (like ``torch.where``).

    Args:
        condition: a bool ``Ragged`` or a bool tensor broadcasting like any operand.
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: ``condition`` is not a bool ``Ragged`` or tensor; no operand is
            ``Ragged``; operands that do not combine (as for :func:`add`).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.tensor([1.0, -2.0, 3.0]), [1, 2])
        >>> raggedfn.where(x > 0, x, 0.0).values.tolist()
        [1.0, 0.0, 3.0]
    """
    fn = "where"
    if not isinstance(condition, (Ragged, Tensor)) or condition.dtype != torch.bool:
        got = (
            f"a {condition.dtype} Ragged value"
            if isinstance(condition, Ragged)
            else describe(condition)
        )
        raise fail(fn, f"condition must be a bool Ragged value or tensor, got {got}")
    if not any(isinstance(v, Ragged) for v in (condition, x, y)):
        raise fail(fn, "needs at least one Ragged operand; use torch.where for dense tensors")
    (c, a, b), partition = align(fn, [condition, x, y])
    return partition.build(torch.where(c, a, b))


def apply(fn: Callable[..., Tensor], x: Ragged, *args: Any, **kwargs: Any) -> Ragged:
    """``fn(values, *args, **kwargs)`` on the packed values of ``x``.

    ``fn`` must act on each packed row independently: pointwise (``torch.relu``),
    or on the trailing dense axes only (``torch.nn.functional.gelu``, a ``Linear``).
    It receives ``[T, *dense]`` with the dense axes in **logical** order (storage is
    permuted first if needed) and must return ``[T, *new dense]``. When the
    number of dense axes changes, the ragged axes of ``x`` must come before all
    dense axes logically; the new dense axes follow them.

    Args:
        fn: the function to apply.
        x: a ``Ragged`` value.
        *args: further positional arguments of ``fn``, passed on unchanged.
        **kwargs: keyword arguments of ``fn``, passed on unchanged.

    Returns:
        ``Ragged`` with the partition of ``x``.

    Raises:
        RaggedError: ``fn`` is not callable; ``x`` is not a ``Ragged`` value; ``fn`` does
            not return a tensor with the same number of packed rows; ``fn`` changes the
            number of dense axes while a dense axis of ``x`` comes before a ragged one.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_lengths(torch.tensor([[1.0, -2.0], [-3.0, 4.0]]), [1, 1])
        >>> raggedfn.apply(torch.relu, x).values.tolist()
        [[1.0, 0.0], [0.0, 4.0]]
        >>> raggedfn.apply(torch.sum, x, dim=-1).shape
        (2, None)
    """
    name = "apply"
    if not callable(fn):
        raise fail(name, f"fn must be callable, got {describe(fn)}")
    if not isinstance(x, Ragged):
        raise fail(name, f"x must be a Ragged value, got {describe(x)}")
    values, layout = reorder_dense(x.values, x.layout, dense_in_logical_order(x.layout))
    out = fn(values, *args, **kwargs)
    if not isinstance(out, Tensor) or out.ndim < 1 or out.shape[0] != values.shape[0]:
        raise fail(
            name,
            f"fn must return a tensor with {values.shape[0]} packed rows, got {describe(out)}",
        )
    if out.ndim != values.ndim:
        if any(a.ragged for a in layout.axes[layout.num_ragged :]):
            raise fail(
                name,
                f"fn changed the number of dense axes ({values.ndim - 1} -> {out.ndim - 1}) but "
                f"x has a dense axis before a ragged axis (logical shape {shape_text(x.shape)}); "
                "permute the ragged axes first",
            )
        ragged = [a for a in layout.axes if a.ragged]
        layout = Layout(tuple(ragged) + tuple(Axis(False, j) for j in range(out.ndim - 1)))
    return like(x, out, layout)
