"""Segment-op suite (issue #3): reductions, softmax and layer_norm over a token batch.

B = 32 samples of ``[N_i, D]`` tokens (D = 256, float32), lengths from the harness's
distributions; each op over the ragged axis (layer_norm over D), forward and
forward+backward. Systems:

- ``raggedfn``: the public ops (``raggedfn.sum(x, dim=1)``, ``raggedfn.amax``, ...);
  a cell says ``missing`` while a name does not exist yet;
- ``padded``: the same op on a zero-padded ``[B, N_max, D]`` tensor with the mask a
  padded model needs (``masked_fill`` before sum/max/softmax); inputs are padded
  outside the timed region;
- ``nested``: ``torch.nested`` jagged tensors (min/max lengths given), where it runs;
- ``loop``: a Python loop over the per-sample tensors (``values.split(lengths)``).

Forward+backward differentiates with ``torch.autograd.grad`` with a fixed random
cotangent, so nothing accumulates between runs. Run it with
``python -m benchmarks.run --only segment_ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import raggedfn
from benchmarks.harness import Case, Missing, Step, Suite, occupancy

OPS = ["sum", "mean", "max", "softmax", "layer_norm"]
REDUCTIONS = {"sum", "mean", "max"}
RAGGEDFN_NAMES = {
    "sum": "sum",
    "mean": "mean",
    "max": "amax",
    "softmax": "softmax",
    "layer_norm": "layer_norm",
}


class Inputs:
    """The data of one case, identical for every system (fixed seed)."""

    def __init__(self, case: Case) -> None:
        gen = torch.Generator().manual_seed(case.seed)
        self.case = case
        self.lengths = list(case.lengths)
        self.dim = case.params["dim"]
        total = sum(self.lengths)
        batch = len(self.lengths)
        dtype, device = case.dtype, case.device
        self.values = torch.randn(total, self.dim, generator=gen, dtype=dtype).to(device)
        self.weight = (1 + 0.1 * torch.randn(self.dim, generator=gen, dtype=dtype)).to(device)
        self.bias = (0.1 * torch.randn(self.dim, generator=gen, dtype=dtype)).to(device)
        shape = (batch, self.dim) if case.workload in REDUCTIONS else (total, self.dim)
        self.cotangent = torch.randn(shape, generator=gen, dtype=dtype).to(device)
        self.x = raggedfn.from_lengths(
            self.values, torch.tensor(self.lengths, dtype=torch.int64, device=device)
        )
        self.backward = case.mode == "fwd+bwd"

    def split(self, packed: Tensor) -> list[Tensor]:
        return list(packed.split(self.lengths))

    def collect_packed(self, out: Tensor) -> list[Tensor]:
        """Per-sample tensors of a packed ``[T, D]`` or a per-sample ``[B, D]`` output."""
        if self.case.workload in REDUCTIONS and not self.backward:
            return list(out.unbind(0))
        return self.split(out)


def _step(
    inputs: Inputs,
    leaf: Tensor,
    forward: Callable[[Tensor], Tensor],
    cotangent: Any,
    collect: Callable[[Tensor], list[Tensor]],
) -> Step:
    """A step that runs ``forward(leaf)``, plus its backward in ``fwd+bwd`` mode."""
    if not inputs.backward:
        return Step(run=lambda: forward(leaf), collect=collect)
    leaf = leaf.detach().clone().requires_grad_(True)

    def run() -> Tensor:
        (grad,) = torch.autograd.grad(forward(leaf), leaf, cotangent)
        return grad

    return Step(run=run, collect=collect)


# ----- systems ----------------------------------------------------------------------------


def build_raggedfn(case: Case) -> Step:
    inputs = Inputs(case)
    name = RAGGEDFN_NAMES[case.workload]
    op = getattr(raggedfn, name, None)
    if op is None:
        raise Missing(f"raggedfn.{name}")
    x, weight, bias, dim = inputs.x, inputs.weight, inputs.bias, inputs.dim

    def forward(values: Tensor) -> Tensor:
        y = x.with_values(values)
        out = op(y, (dim,), weight, bias) if case.workload == "layer_norm" else op(y, 1)
        return out.values if isinstance(out, raggedfn.Ragged) else out

    return _step(inputs, inputs.values, forward, inputs.cotangent, inputs.collect_packed)


def build_padded(case: Case) -> Step:
    inputs = Inputs(case)
    padded = raggedfn.to_padded(inputs.x)
    keep = raggedfn.mask(inputs.x).unsqueeze(-1)
    drop = ~keep
    lengths = inputs.x.lengths.to(padded.dtype).unsqueeze(-1)
    weight, bias, dim = inputs.weight, inputs.bias, inputs.dim
    workload = case.workload

    def forward(p: Tensor) -> Tensor:
        if workload == "sum":
            return p.masked_fill(drop, 0).sum(1)
        if workload == "mean":
            return p.masked_fill(drop, 0).sum(1) / lengths
        if workload == "max":
            return p.masked_fill(drop, float("-inf")).amax(1)
        if workload == "softmax":
            return p.masked_fill(drop, float("-inf")).softmax(1)
        return F.layer_norm(p, (dim,), weight, bias)

    cotangent = inputs.cotangent
    if workload not in REDUCTIONS:
        cotangent = raggedfn.to_padded(inputs.x.with_values(inputs.cotangent))

    def collect(out: Tensor) -> list[Tensor]:
        if workload in REDUCTIONS and not inputs.backward:
            return list(out.unbind(0))
        return [out[i, :n] for i, n in enumerate(inputs.lengths)]

    return _step(inputs, padded, forward, cotangent, collect)


def build_nested(case: Case) -> Step:
    inputs = Inputs(case)
    offsets = inputs.x.offsets
    low, high = min(inputs.lengths), max(inputs.lengths)
    weight, bias, dim = inputs.weight, inputs.bias, inputs.dim
    workload = case.workload

    def forward(values: Tensor) -> Tensor:
        njt = torch.nested.nested_tensor_from_jagged(
            values, offsets, min_seqlen=low, max_seqlen=high
        )
        if workload == "sum":
            return njt.sum(dim=1)
        if workload == "mean":
            return njt.mean(dim=1)
        if workload == "max":
            return njt.amax(dim=1)
        if workload == "softmax":
            return njt.softmax(dim=1).values()
        return F.layer_norm(njt, (dim,), weight, bias).values()

    step = _step(inputs, inputs.values, forward, inputs.cotangent, inputs.collect_packed)
    step.run()  # fail here (reported as "fails: ...") rather than while timing
    return step


def build_loop(case: Case) -> Step:
    inputs = Inputs(case)
    weight, bias, dim = inputs.weight, inputs.bias, inputs.dim
    workload = case.workload
    lengths = inputs.lengths

    def one(t: Tensor) -> Tensor:
        if workload == "sum":
            return t.sum(0)
        if workload == "mean":
            return t.mean(0)
        if workload == "max":
            return t.amax(0)
        if workload == "softmax":
            return t.softmax(0)
        return F.layer_norm(t, (dim,), weight, bias)

    cotangents = (
        list(inputs.cotangent.unbind(0))
        if workload in REDUCTIONS
        else inputs.split(inputs.cotangent)
    )
    leaf = inputs.values if not inputs.backward else inputs.values.detach().clone().requires_grad_()

    def forward() -> list[Tensor]:
        return [one(t) for t in leaf.split(lengths)]

    if not inputs.backward:
        return Step(run=forward, collect=lambda out: list(out))

    def run() -> Tensor:
        (grad,) = torch.autograd.grad(forward(), leaf, cotangents)
        return grad

    return Step(run=run, collect=inputs.split)


def _params(quick: bool) -> dict[str, Any]:
    # quick: same B and D, lengths halved (the occupancy, hence the ideal ratio, is kept)
    return {"batch": 32, "dim": 256, "scale": 0.5 if quick else 1.0}


SUITE = Suite(
    name="segment_ops",
    workloads=OPS,
    modes=["fwd", "fwd+bwd"],
    systems={
        "padded": build_padded,
        "raggedfn": build_raggedfn,
        "nested": build_nested,
        "loop": build_loop,
    },
    params=_params,
    distributions=lambda quick: ["lognormal"] if quick else ["lognormal", "equal"],
    ideal_ratio=lambda case: occupancy(case.lengths),
)
