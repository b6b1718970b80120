"""``_prims._apply.apply``: Function.apply without its per-call signature binding."""

from __future__ import annotations

from typing import Any

import torch
from torch.func import grad, vmap

from raggedfn._prims import _apply, segment_amax, segment_softmax


class _Scale(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return 3 * g * ctx.factor, None  # deliberately not the true derivative: which rule ran


def test_apply_runs_the_custom_rule_eagerly_and_under_transforms():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (g,) = torch.autograd.grad(_apply.apply(_Scale, x, 2.0).sum(), x)
    assert g.tolist() == [6.0, 6.0]  # the custom backward, not autograd of x * factor
    assert grad(lambda v: _apply.apply(_Scale, v, 2.0).sum())(x.detach()).tolist() == [6.0, 6.0]
    assert vmap(lambda v: _apply.apply(_Scale, v, 2.0))(torch.ones(3, 2)).shape == (3, 2)


def test_a_missing_default_argument_takes_the_general_path():
    x = torch.tensor([1.0, 2.0])
    assert _apply.apply(_Scale, x).tolist() == [2.0, 4.0]  # factor filled in by Function.apply


def test_segment_prims_pass_gradcheck_through_it():
    values = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    segments = torch.tensor([0, 0, 2, 2, 2, 3, 3])
    torch.autograd.gradcheck(lambda v: segment_softmax(v, segments, 4), (values,))
    torch.autograd.gradgradcheck(lambda v: segment_amax(v, segments, 4), (values,))


def test_anything_else_with_an_apply_is_called_as_is():
    class NotAFunction:
        @staticmethod
        def apply(x: torch.Tensor) -> torch.Tensor:
            return x + 1

    assert _apply.apply(NotAFunction, torch.zeros(2)).tolist() == [1.0, 1.0]  # type: ignore[arg-type]
