"""``segment_matmul`` for every count of non-empty groups: none, one, two and more.

The forward concatenates one GEMM result per non-empty group (one piece is
returned as is, several are concatenated), so each count is its own path; each is
compared with ``rows @ weight[g] + bias[g]`` group by group, with gradients.
"""

from __future__ import annotations

import pytest
import torch

from raggedfn._prims import segment_matmul

LENGTHS = {  # group lengths; the empty groups have no piece
    "none": [0, 0, 0],
    "one": [0, 4, 0],
    "two": [3, 0, 2],
    "three": [1, 2, 3],
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", sorted(LENGTHS))
def test_segment_matmul_equals_the_group_loop(case: str, bias: bool) -> None:
    lengths = LENGTHS[case]
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(sum(lengths), 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    out = segment_matmul(x, offsets, w, b)
    groups = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    want = torch.stack([x[t] @ w[g] + (b[g] if b is not None else 0) for t, g in enumerate(groups.tolist())]) if len(groups) else x.new_zeros(0, 2)  # fmt: skip
    assert out.shape == want.shape
    torch.testing.assert_close(out, want)
    if len(groups):
        leaves = [t for t in (x, w, b) if t is not None]
        cotangent = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        mine = torch.autograd.grad(out, leaves, cotangent)
        theirs = torch.autograd.grad(want, leaves, cotangent)
        for a, c in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, c)
