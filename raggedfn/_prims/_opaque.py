"""Host-planned ops as opaque custom ops, so that ``torch.compile`` keeps one graph.

Some ops plan their work on the host from the sizes (``attention`` and the
products that contract a ragged axis group samples into length buckets). Traced
by dynamo, that planning would be a graph break. Under compile these ops are
called through :func:`host_planned` instead: a ``torch.library`` custom op that
dynamo records as one node. Its fake implementation only states the output
shape (given by the caller, from sizes already in the graph), and at run time
the real implementation runs the eager op on real tensors, bucket plan and all.

The backward is a second custom op that recomputes the eager op under autograd
and returns the input gradients (so the forward saves no intermediates, only
its inputs). It is itself opaque: a compiled graph cannot be differentiated
twice through it, and ``torch.func`` transforms of a compiled function that
reaches it raise; eagerly none of this is used.

The ops layer registers each eager implementation by name with
:func:`implement`, which keeps this module free of imports from ``ops``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._forward import refuse_compiled

Impl = Callable[[Sequence[Tensor], str], Tensor]
_IMPLS: dict[str, Impl] = {}


def implement(name: str) -> Callable[[Impl], Impl]:
    """Register the eager implementation ``fn(tensors, meta) -> Tensor`` of op ``name``."""

    def register(fn: Impl) -> Impl:
        _IMPLS[name] = fn
        return fn

    return register


@torch.library.custom_op("raggedfn::host_planned", mutates_args=())
def _host_planned(name: str, meta: str, tensors: list[Tensor], shape: list[int]) -> Tensor:
    out = _IMPLS[name](tensors, meta)
    if tuple(out.shape) != tuple(shape):  # the caller's shape must describe the real result
        raise RuntimeError(
            f"raggedfn::host_planned({name}): result of shape {tuple(out.shape)}, "
            f"expected {tuple(shape)}"
        )
    return out.contiguous()


@_host_planned.register_fake
def _host_planned_fake(name: str, meta: str, tensors: list[Tensor], shape: list[int]) -> Tensor:
    return tensors[0].new_empty(shape)


@torch.library.custom_op("raggedfn::host_planned_backward", mutates_args=())
def _host_planned_backward(
    name: str, meta: str, tensors: list[Tensor], grad: Tensor
) -> list[Tensor]:
    # the custom-op dispatcher runs this below autograd; torch.func.vjp records anyway
    floating = [n for n, t in enumerate(tensors) if t.is_floating_point()]

    def run(*wrt: Tensor) -> Tensor:
        args = list(tensors)
        for n, t in zip(floating, wrt, strict=True):
            args[n] = t
        return _IMPLS[name](args, meta)

    pullback = torch.func.vjp(run, *(tensors[n] for n in floating))[1]
    grads = dict(zip(floating, pullback(grad), strict=True))
    result = []
    for n, t in enumerate(tensors):
        g = grads.get(n)
        result.append(torch.zeros_like(t) if g is None else g.contiguous())
    return result


@_host_planned_backward.register_fake
def _host_planned_backward_fake(
    name: str, meta: str, tensors: list[Tensor], grad: Tensor
) -> list[Tensor]:
    return [torch.empty_like(t) for t in tensors]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    name, meta, tensors, _ = inputs
    ctx.name, ctx.meta = name, meta
    ctx.save_for_backward(*tensors)


def _backward(ctx: Any, grad: Tensor) -> tuple[None, None, list[Tensor | None], None]:
    tensors = list(ctx.saved_tensors)
    grads = _host_planned_backward(ctx.name, ctx.meta, tensors, grad)
    return (
        None,
        None,
        [g if t.is_floating_point() else None for g, t in zip(grads, tensors, strict=True)],
        None,
    )


_host_planned.register_autograd(_backward, setup_context=_setup_context)


def host_planned(name: str, meta: str, tensors: Sequence[Tensor], shape: Sequence[int]) -> Tensor:
    """Run the registered op ``name`` as one opaque graph node.

    Args:
        name: the name given to :func:`implement`.
        meta: static arguments, encoded as a string by the caller.
        tensors: tensor arguments; the first sets the result's dtype and device.
        shape: the result's shape (symbolic sizes allowed).

    Raises:
        RaggedError: under forward-mode AD (a custom op has no forward-mode rule
            here, and torch.func would otherwise give zero tangents through it).
    """
    refuse_compiled(name, "ops that plan on the host run as one opaque custom op there")
    return _host_planned(name, meta, list(tensors), list(shape))
