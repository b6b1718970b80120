"""Elementwise comparisons of ``Ragged`` values: ``eq``, ``ne``, ``lt``, ``le``, ``gt``, ``ge``.

Operands combine as for the arithmetic ops (``_elementwise``): ``Ragged`` values,
Python numbers, 0-d tensors or dense tensors broadcasting against the logical
shape. The result is a bool ``Ragged``; order comparisons refuse complex operands.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import Tensor

from .._errors import fail, require_ordered
from .._ragged import Ragged
from ._elementwise import _binary

__all__ = ["eq", "ge", "gt", "le", "lt", "ne"]


def _ordered(fn: str, x: Any, y: Any) -> None:
    """Order comparisons refuse complex operands (complex numbers have no order)."""
    for op in (x, y):
        if isinstance(op, (Ragged, Tensor)):
            require_ordered(fn, op.dtype)
        elif isinstance(op, complex):
            raise fail(fn, f"expected a real operand (complex numbers have no order), got {op!r}")


def eq(x: Any, y: Any) -> Any:
    """``x == y`` elementwise, a bool ``Ragged``.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        bool ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1, 2]), [2]) == 2).values.tolist()
        [False, True]
    """
    return _binary("eq", operator.eq, x, y)


def ne(x: Any, y: Any) -> Any:
    """``x != y`` elementwise, a bool ``Ragged``.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        bool ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1, 2]), [2]) != 2).values.tolist()
        [True, False]
    """
    return _binary("ne", operator.ne, x, y)


def lt(x: Any, y: Any) -> Any:
    """``x < y`` elementwise, a bool ``Ragged``.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        bool ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1, 2]), [2]) < 2).values.tolist()
        [True, False]
    """
    _ordered("lt", x, y)
    return _binary("lt", operator.lt, x, y)


def le(x: Any, y: Any) -> Any:
    """``x <= y`` elementwise, a bool ``Ragged``.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        bool ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1, 2]), [2]) <= 1).values.tolist()
        [True, False]
    """
    _ordered("le", x, y)
    return _binary("le", operator.le, x, y)


def gt(x: Any, y: Any) -> Any:
    """``x > y`` elementwise, a bool ``Ragged``.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        bool ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1, 2]), [2]) > 1).values.tolist()
        [False, True]
    """
    _ordered("gt", x, y)
    return _binary("gt", operator.gt, x, y)


def ge(x: Any, y: Any) -> Any:
    """``x >= y`` elementwise, a bool ``Ragged``.

    Args:
        x: ``Ragged`` values, numbers or broadcastable tensors.
        y: the other operand, like ``x``.

    Returns:
        bool ``Ragged`` with the broadcast logical shape.

    Raises:
        RaggedError: neither operand is a ``Ragged`` value or a tensor; two ``Ragged``
            operands with different partitions (samples or sizes) or logical shapes; a
            tensor that does not broadcast against the logical shape (only size 1 broadcasts
            along a ragged axis, and along the batch axis only ``B`` or 1); an operand on
            another device.

    Examples:
        >>> import torch, raggedfn
        >>> (raggedfn.from_lengths(torch.tensor([1, 2]), [2]) >= 2).values.tolist()
        [False, True]
    """
    _ordered("ge", x, y)
    return _binary("ge", operator.ge, x, y)
