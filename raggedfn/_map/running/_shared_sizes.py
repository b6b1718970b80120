"""Data-dependent sizes made by an op on shared values only (``w[w > 0]`` of a tensor
every sample shares): the same for every sample, read from the op's result."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..base._sizes import Sz
from ..base._steps import Step, TSpec
from ..base._values import BATCHED, Ctx


def bind_shared_sizes(ctx: Ctx, step: Step, result: Any) -> None:
    """Record in ``ctx.env`` each size ``step`` (not batched: it ran once, on shared
    values) defines, as ``[B]``: its result's size along the axis the trace named."""
    outs = result if isinstance(result, (tuple, list)) else (result,)
    specs = step.out if isinstance(step.out, (tuple, list)) else (step.out,)
    for value, spec in zip(outs, specs, strict=False):
        if not isinstance(value, Tensor) or not isinstance(spec, TSpec):
            continue
        for size, traced in zip(value.shape, spec.shape, strict=False):
            if isinstance(traced, Sz) and traced.key in step.defines and traced.key not in ctx.env:
                ctx.env[traced.key] = torch.full(
                    (ctx.batch_size,), size, dtype=torch.int64, device=ctx.device
                )


def ran_once(result: Any) -> bool:
    """No batched value in ``result``: the op ran once, on shared operands (a plan
    under ``n == 0`` where ``f`` selects from ``t.new_zeros(2)``)."""
    parts = result if isinstance(result, (tuple, list)) else (result,)
    return not any(isinstance(r, BATCHED) for r in parts)


__all__ = ["bind_shared_sizes", "ran_once"]
