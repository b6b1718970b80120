"""Per-sample ``torch.matmul`` over ragged and dense operands: the rank rules of torch's
matmul turned into einsum subscripts (see ``_products.einsum``), the checks that name
mismatched operands, and the one product that needs no plan (a dense weight on the last,
last-stored axis: a single ``values @ w``, the loop's own rows)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._axes import logical_shape_text
from .._errors import describe, fail, shape_text
from .._ragged import Ragged
from ._products import einsum

__all__ = ["matmul"]


def _matmul_subscripts(fn: str, rank_a: int, rank_b: int) -> tuple[str, str, str]:
    """Per-sample ``torch.matmul`` subscripts (without the batch letter)."""
    if rank_a < 1 or rank_b < 1:
        raise fail(fn, f"operands need at least one sample axis, got ranks {rank_a} and {rank_b}")
    if rank_a == 1 and rank_b == 1:
        return "k", "k", ""
    if rank_a == 1:
        lead = "ABCDEFGH"[: rank_b - 2]
        return "k", lead + "kj", lead + "j"
    if rank_b == 1:
        lead = "ABCDEFGH"[: rank_a - 2]
        return lead + "ik", "k", lead + "i"
    lead_a = "ABCDEFGH"[: rank_a - 2]
    lead_b = "ABCDEFGH"[: rank_b - 2]
    lead = lead_a if len(lead_a) >= len(lead_b) else lead_b
    lead_a, lead_b = lead[len(lead) - len(lead_a) :], lead[len(lead) - len(lead_b) :]
    return lead_a + "ik", lead_b + "kj", lead + "ij"


def matmul(a: Ragged | Tensor, b: Ragged | Tensor) -> Ragged | Tensor:
    """Per-sample ``torch.matmul``: ``[a_i @ b_i for each sample i]``.

    A dense tensor operand is shared by all samples (a weight). Typical uses:
    ``x @ W`` with ``x (B, N*, D)`` and ``W [D, E]`` gives ``(B, N*, E)``;
    ``matmul(q, transpose(k, 1, 2))`` with ``q (B, N*, D)`` and ``k (B, M*, D)``
    gives the score state ``(B, N*, M*)`` (sizes ``(N_i, M_i)``); ``matmul(p, v)``
    with ``p (B, N*, M*)`` and ``v (B, M*, D)`` contracts the ragged axis and gives
    ``(B, N*, D)``. Leading sample axes must match (no broadcasting of size 1
    against a ragged axis). Gradients flow to every floating operand. Nested
    values multiply per element of their outer levels (see :func:`einsum`):
    ``matmul(docs, transpose(docs, 2, 3))`` is a pair state per sentence.

    Args:
        a: ``Ragged`` or tensor.
        b: ``Ragged`` or tensor.

    Returns:
        ``Ragged`` (or a dense ``[B, ...]`` tensor when no ragged axis remains).

    Raises:
        RaggedError: an operand is neither ``Ragged`` nor a tensor; a dense operand that is
            not a ``[K]``/``[K, N]`` (right) or ``[K]``/``[M, K]`` (left) weight; a ragged
            contracted axis against a dense operand; two ``Ragged`` operands whose
            partitions do not match; an inner (contracted) size that differs; forward-mode
            AD inside ``torch.compile`` with two ``Ragged`` operands (one opaque node
            there, see docs/transforms.md).

    Examples:
        >>> import torch, raggedfn
        >>> q = raggedfn.from_list([torch.randn(2, 4), torch.randn(3, 4)])
        >>> (q @ torch.randn(4, 5)).shape
        (2, None, 5)
        >>> kt = raggedfn.einsum('bnd->bdn', q)
        >>> raggedfn.matmul(q, kt).sizes.tolist()
        [[2, 2], [3, 3]]
    """
    fn = "matmul"
    if not isinstance(a, Ragged) and not isinstance(b, Ragged):
        if not isinstance(a, Tensor) or not isinstance(b, Tensor):
            raise fail(fn, f"operands must be Ragged values or tensors, got {describe(a)}")
        return torch.matmul(a, b)
    for name, op in (("a", a), ("b", b)):
        if not isinstance(op, (Ragged, Tensor)):
            raise fail(fn, f"{name} must be a Ragged value or a tensor, got {describe(op)}")
    problem = matmul_mismatch(a, b)
    if problem is not None:
        raise fail(fn, problem)
    if (
        isinstance(a, Ragged)
        and isinstance(b, Tensor)
        and b.ndim == 2
        and not a.row_offsets
        and a.values.ndim >= 2
        and not a.layout.axes[-1].ragged
        and a.layout.axes[-1].index == a.values.ndim - 2
        and _ragged_first(a)
    ):
        # a dense weight on the last axis, stored last: one product of the packed values
        # (the loop's own `s @ w` rows), no einsum plan
        return a.with_values(a.values @ b)
    rank_a = a.layout.rank if isinstance(a, Ragged) else a.ndim
    rank_b = b.layout.rank if isinstance(b, Ragged) else b.ndim
    sub_a, sub_b, sub_out = _matmul_subscripts(fn, rank_a, rank_b)
    batch = next(c for c in "zyxw" if c not in sub_a + sub_b)
    if isinstance(a, Ragged):
        sub_a = batch + sub_a
    if isinstance(b, Ragged):
        sub_b = batch + sub_b
    return einsum(f"{sub_a},{sub_b}->{batch}{sub_out}", a, b)


def _ragged_first(x: Ragged) -> bool:
    count = sum(1 for axis in x.layout.axes if axis.ragged)
    return all(axis.ragged for axis in x.layout.axes[:count])


def _shape_of(op: Ragged | Tensor) -> str:
    if isinstance(op, Ragged):
        return f"logical shape (B={op.batch_size}, {logical_shape_text(op)[1:]}"
    return f"shape {shape_text(op.shape)}"


def _inner(op: Ragged | Tensor, left: bool) -> tuple[int, bool, Any]:
    """``(sample axis, ragged?, dense size)`` that ``matmul`` contracts in ``op``."""
    if isinstance(op, Ragged):
        rank = op.layout.rank
        position = rank - 1 if left or rank == 1 else rank - 2
        axis = op.layout.axes[position]
        size = None if axis.ragged else op.values.shape[1 + axis.index]
        return position, axis.ragged, size
    position = op.ndim - 1 if left or op.ndim == 1 else op.ndim - 2
    return position, False, op.shape[position]


def matmul_fits(a: Ragged | Tensor, b: Ragged | Tensor) -> bool:
    """Whether ``matmul(a, b)`` (one operand ``Ragged``) can run, reading only ranks and
    the contracted sizes: the operator dispatch under ``torch.compile`` asks it of
    ``x @ W`` and ``W @ x`` (see :mod:`._operators`) without formatting a message that
    would read, and so specialize, the batch size and the other sizes."""
    return _mismatch(a, b) is None


def matmul_mismatch(a: Ragged | Tensor, b: Ragged | Tensor) -> str | None:
    """Why ``matmul(a, b)`` (one operand ``Ragged``) cannot run, or ``None`` when it can."""
    why = _mismatch(a, b)
    return None if why is None else why()


def _mismatch(a: Ragged | Tensor, b: Ragged | Tensor) -> Callable[[], str] | None:
    """``matmul_mismatch`` with the message left unformatted until asked for."""
    rank_a = a.layout.rank if isinstance(a, Ragged) else a.ndim
    rank_b = b.layout.rank if isinstance(b, Ragged) else b.ndim
    if rank_a < 1 or rank_b < 1:
        return lambda: (
            f"expected operands with at least one sample axis, got ranks {rank_a} and {rank_b}"
        )
    if isinstance(a, Ragged) and isinstance(b, Tensor) and b.ndim > 2:
        return lambda: f"expected a dense right operand b of shape [K] or [K, N], got {describe(b)}"
    if isinstance(b, Ragged) and isinstance(a, Tensor) and a.ndim > 2:
        return lambda: f"expected a dense left operand a of shape [K] or [M, K], got {describe(a)}"
    pos_a, ragged_a, size_a = _inner(a, left=True)
    pos_b, ragged_b, size_b = _inner(b, left=False)
    if ragged_a or ragged_b:
        if isinstance(a, Ragged) and isinstance(b, Ragged) and ragged_a and ragged_b:
            return None  # ragged contraction: the sizes are compared per sample
        name, op = ("a", a) if ragged_a else ("b", b)
        other = b if name == "a" else a
        if not isinstance(other, Ragged):
            return lambda: (
                f"expected the other operand to be Ragged since {name} of {_shape_of(op)} has a "
                f"ragged contracted axis, got {describe(other)}"
            )
        return lambda: (
            f"expected the contracted axes to be both ragged or both dense, got a of "
            f"{_shape_of(a)} (axis {1 + pos_a}) and b of {_shape_of(b)} (axis {1 + pos_b})"
        )
    if size_a != size_b:
        where_b = "" if isinstance(b, Ragged) else f" along axis {pos_b}"
        return lambda: (
            f"expected b to have the inner size {size_a} of a{where_b}, got a of {_shape_of(a)} "
            f"and b of {_shape_of(b)}"
        )
    return None
