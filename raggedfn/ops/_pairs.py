"""``pairs``: every element pair of each sample, as a pair state or a list of pairs."""

from __future__ import annotations

import torch
from torch import Tensor

from .._errors import describe, fail, shape_text
from .._index import coordinates, offsets_of, segment_ids
from .._layout import Axis, Layout
from .._ragged import Ragged

__all__ = ["pairs"]


def _pair_coordinates(
    local: Tensor, n: Tensor, diagonal: bool, ordered: bool
) -> tuple[Tensor, Tensor]:
    """``(i, j)`` of the ``local``-th pair of a sample of ``n`` elements (R = 1 forms)."""
    if ordered:  # all i != j, row-major
        width = (n - 1).clamp(min=1)
        i = torch.div(local, width, rounding_mode="floor")
        rest = local - i * width
        return i, rest + (rest >= i).to(rest.dtype)
    size = n + 1 if diagonal else n  # i <= j over n  ==  i < j' over n + 1, j = j' - 1

    def start(row: Tensor) -> Tensor:
        return torch.div(row * (2 * size - row - 1), 2, rounding_mode="floor")

    span = (2 * size - 1).to(torch.float64)
    root = torch.sqrt((span * span - 8 * local.to(torch.float64)).clamp(min=0))
    i = torch.floor((span - root) / 2).to(torch.int64).clamp(min=0)
    i = i - (start(i) > local).to(i.dtype)
    i = i + (start(i + 1) <= local).to(i.dtype)
    j = local - start(i) + i + 1
    return i, j - 1 if diagonal else j


def pairs(x: Ragged, *, diagonal: bool = True, ordered: bool = True) -> tuple[Ragged, Ragged]:
    """All element pairs ``(x_i[a], x_i[b])`` of each sample, as two values.

    Args:
        x: ``(B, N*, *dense)`` with one ragged axis first.
        diagonal: include the pairs ``a == b``.
        ordered: all ordered pairs; else only ``a < b`` (``a <= b`` with the
            diagonal), like ``itertools.combinations`` (``_with_replacement``).

    Returns:
        ``(left, right)``: with ``ordered=True, diagonal=True`` two pair states
        ``(B, N*, N*, *dense)`` with sizes ``(N_i, N_i)`` and ``left[a, b] = x[a]``,
        ``right[a, b] = x[b]``. The other forms are not rectangles, so they are
        ``(B, P*, *dense)`` lists of pairs in lexicographic ``(a, b)`` order
        (``P_i = N_i (N_i - 1)``, ``N_i (N_i - 1) / 2`` or ``N_i (N_i + 1) / 2``).

    Raises:
        RaggedError: ``x`` is not a ``Ragged`` value, or it does not have one ragged axis at
            logical axis 1.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.tensor([1.0, 2.0, 3.0])])
        >>> a, b = raggedfn.pairs(x, diagonal=False, ordered=False)
        >>> a.values.tolist(), b.values.tolist()
        ([1.0, 1.0, 2.0], [2.0, 3.0, 3.0])
    """
    fn = "pairs"
    if not isinstance(x, Ragged):
        raise fail(fn, f"x must be a Ragged value, got {describe(x)}")
    if x.num_ragged != 1 or not x.layout.axes[0].ragged:
        raise fail(
            fn, f"x must have one ragged axis at logical axis 1, got shape {shape_text(x.shape)}"
        )
    n = x.sizes[:, 0]
    if ordered and diagonal:
        sizes = torch.stack([n, n], dim=1)
        layout = Layout((Axis(True, 0), Axis(True, 1), *x.layout.axes[1:]))
        offsets = offsets_of(n * n)
        total = int(offsets[-1])
        segments, (a, b) = coordinates(offsets, sizes, total)
    else:
        if ordered:
            count = n * (n - 1)
        elif diagonal:
            count = torch.div(n * (n + 1), 2, rounding_mode="floor")
        else:
            count = torch.div(n * (n - 1), 2, rounding_mode="floor")
        sizes = count.unsqueeze(1)
        layout = x.layout
        offsets = offsets_of(count)
        total = int(offsets[-1])
        segments = segment_ids(offsets, total)
        local = torch.arange(total, device=x.device) - offsets[segments]
        a, b = _pair_coordinates(local, n[segments], diagonal, ordered)
    start = x.offsets[segments]
    left = Ragged(x.values[start + a], offsets, sizes, layout)
    right = Ragged(x.values[start + b], offsets, sizes, layout)
    return left, right
