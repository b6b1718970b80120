"""Token MLP suite (issue #6, the FCN case): per-token Linear-GELU-Linear.

d_model 256 and 1024 (hidden 4x), forward and forward+backward (w.r.t. the input
and the four parameters, fixed cotangent), eager, on every length distribution.
Systems as in ``benchmarks._systems``: ``raggedfn`` (``raggedfn.linear`` /
``apply(F.gelu)``), ``map`` of the per-sample MLP, ``padded`` (the MLP on
``[B, N_max, D]``: padding needs no mask here, it is only wasted work),
``nested`` (torch.nested jagged), ``danling`` and the per-sample ``loop``.

The ideal ratio is ``sum N / (B * N_max)``. Sizes per width in ``SIZES`` (batch,
length scale), chosen for the 2-core CPU budget. Run:
``python -m benchmarks.run --only token_mlp``.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import raggedfn
from benchmarks._systems import Model, Params, SizedSuite, lengths_by_workload, systems_for
from benchmarks.harness import occupancy
from raggedfn import Ragged

WIDTHS = {"mlp-256": 256, "mlp-1024": 1024}
# (batch, length scale) per width, sized for `make bench` < 15 min at 1 thread on 2 cores:
# mlp-256 keeps B = 32 (the distributions' occupancy exactly); mlp-1024 costs 16x per token
SIZES = {
    False: {"mlp-256": (32, 0.25), "mlp-1024": (16, 0.0625)},
    True: {"mlp-256": (16, 0.25), "mlp-1024": (8, 0.0625)},
}


def make_params(dim: int, gen: torch.Generator, dtype: torch.dtype) -> Params:
    """``w1 [4D, D]``, ``b1``, ``w2 [D, 4D]``, ``b2``, fixed by ``gen``."""
    return {
        "w1": torch.randn(4 * dim, dim, generator=gen, dtype=dtype) / math.sqrt(dim),
        "b1": 0.02 * torch.randn(4 * dim, generator=gen, dtype=dtype),
        "w2": torch.randn(dim, 4 * dim, generator=gen, dtype=dtype) / math.sqrt(4 * dim),
        "b2": 0.02 * torch.randn(dim, generator=gen, dtype=dtype),
    }


def mlp(x: Any, p: Params) -> Any:
    """The MLP on anything ``F.linear`` accepts: a sample, a padded, nested or danling batch."""
    return F.linear(F.gelu(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])


def mlp_ragged(x: Ragged, p: Params) -> Ragged:
    """The MLP with raggedfn's ops."""
    h = raggedfn.apply(F.gelu, raggedfn.linear(x, p["w1"], p["b1"]))
    return raggedfn.linear(h, p["w2"], p["b2"])


def mlp_batched(x: Any, p: Params, mask: Tensor | None) -> Any:
    return mlp(x, p)


@cache
def model(workload: str) -> Model:
    dim = WIDTHS[workload]
    return Model(dim, lambda gen, dtype: make_params(dim, gen, dtype), mlp, mlp_ragged, mlp_batched)


def _distributions(quick: bool) -> list[str]:
    return ["lognormal", "equal"] if quick else ["lognormal", "medium", "low", "equal"]


SUITE = SizedSuite(
    name="token_mlp",
    workloads=list(WIDTHS),
    modes=["fwd", "fwd+bwd"],
    systems=systems_for(lambda case: model(case.workload)),
    params=lambda quick: {
        "quick": quick,
        "sizes": SIZES[quick],
        "lengths": lengths_by_workload(SIZES[quick], _distributions(quick)),
    },
    distributions=_distributions,
    ideal_ratio=lambda case: occupancy(case.lengths, 1),
    memory_for=lambda case: (
        not case.params["quick"] and case.mode == "fwd+bwd" and case.distribution == "lognormal"
    ),
    runs=lambda case: not case.params["quick"] or case.mode == "fwd+bwd",
    sizes=lambda quick: SIZES[quick],
)
