"""A differentiable ``all_to_all_single`` with uneven splits (for ``raggedfn.distributed``).

``torch.distributed.nn.functional.all_to_all_single`` is deprecated in torch 2.13
(it warns), and the functional collective's autograd is registered with
``torch.library.register_autograd``, which ``torch.func.grad`` refuses (see
REFERENCES.md). So the rule lives here, in the form ``torch.func`` accepts.
The backward is the reverse exchange (splits swapped), built from this same
primitive, so it is differentiable again; the ``jvp`` exchanges the tangent like
the primal. No vmap rule: a collective cannot run once per vmapped slice.

When nothing can differentiate the call (no gradient wanted, no ``torch.func``
transform, no forward-mode tangent, not tracing) the exchange runs directly:
``Function.apply`` binds its arguments with ``inspect.signature`` on every call,
which costs as much as the rest of a small exchange's Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import forward_ad


def all_to_all_single(
    values: Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Any = None
) -> Tensor:
    """Rows ``values[sum(input_splits[:r]) : ...]`` go to rank ``r``; the rows received
    from every rank are concatenated in rank order.

    Args:
        values: ``[sum(input_splits), *rest]``.
        output_splits: rows received from each rank (Python ints).
        input_splits: rows sent to each rank (Python ints).
        group: the process group (``None``: the default group).

    Returns:
        ``[sum(output_splits), *rest]``.
    """
    if _untracked(values):
        return _exchange(values, output_splits, input_splits, group)
    out: Tensor = _AllToAll.apply(values, tuple(output_splits), tuple(input_splits), group)
    return out


def _untracked(values: Tensor) -> bool:
    """No autograd, ``torch.func`` transform, forward-mode tangent or tracer can see ``values``."""
    return (
        not (values.requires_grad and torch.is_grad_enabled())
        and type(values) is Tensor
        and not torch._C._are_functorch_transforms_active()
        and forward_ad.unpack_dual(values).tangent is None
        and not torch.compiler.is_compiling()
    )


def _exchange(
    values: Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Any
) -> Tensor:
    out = values.new_empty((sum(output_splits), *values.shape[1:]))
    dist.all_to_all_single(
        out, values.contiguous(), list(output_splits), list(input_splits), group=group
    )
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        values: Tensor, output_splits: tuple[int, ...], input_splits: tuple[int, ...], group: Any
    ) -> Tensor:
        return _exchange(values, output_splits, input_splits, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.output_splits, ctx.input_splits, ctx.group = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        back = all_to_all_single(grad, list(ctx.input_splits), list(ctx.output_splits), ctx.group)
        return back, None, None, None

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: Any) -> Tensor:
        return all_to_all_single(
            tangent, list(ctx.output_splits), list(ctx.input_splits), ctx.group
        )
