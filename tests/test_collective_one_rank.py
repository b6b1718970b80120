"""The all_to_all primitive in this process, on a gloo group of one rank.

``tests/test_distributed*.py`` exchange between 2 spawned ranks; on one rank the
exchange sends every row to itself, so the result, its gradient and its tangent are
the input's, the seed and the tangent: the rule's own code runs here, where coverage
and mutation testing see it.
"""

from __future__ import annotations

import torch

from raggedfn._prims._collective import all_to_all_single
from tests.test_map_fsdp_one_rank import group  # noqa: F401  (the one-rank gloo group)


def test_all_to_all_of_one_rank_returns_its_rows_with_their_gradient(group) -> None:  # noqa: F811
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    seed = torch.randn(5, 3, 2, dtype=torch.float64, generator=gen)
    out = all_to_all_single(values, [5], [5])
    assert out.shape == values.shape and out.grad_fn is not None
    torch.testing.assert_close(out, values.detach(), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out, values, seed)
    torch.testing.assert_close(grad, seed, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda v: all_to_all_single(v, [5], [5]), (values,))
    assert torch.autograd.gradgradcheck(lambda v: all_to_all_single(v, [5], [5]), (values,))


def test_all_to_all_of_one_rank_carries_a_tangent(group) -> None:  # noqa: F811
    values = torch.randn(4, 3, dtype=torch.float64)
    tangent = torch.randn(4, 3, dtype=torch.float64)
    out, out_tangent = torch.func.jvp(
        lambda v: all_to_all_single(v, [4], [4]), (values,), (tangent,)
    )
    torch.testing.assert_close(out, values, rtol=0, atol=0)
    torch.testing.assert_close(out_tangent, tangent, rtol=0, atol=0)


def test_an_empty_exchange_keeps_the_dense_shape(group) -> None:  # noqa: F811
    values = torch.zeros(0, 3, 2, requires_grad=True)
    out = all_to_all_single(values, [0], [0])
    assert out.shape == (0, 3, 2)
