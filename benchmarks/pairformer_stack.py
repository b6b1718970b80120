"""Pairformer-style stack suite (issue #6): four blocks on pair states, C = 32.

The block is the PAIRS engineer's (``benchmarks.pairformer``: triangle
multiplicative updates outgoing and incoming, triangle attention with pair bias,
transition), imported, not rewritten; this suite runs a stack of ``BLOCKS = 4``
of them on a low- and a high-variation batch of lengths 32..256
(``pair_low`` / ``pair_high``, B = 4), next to the padded stack and a per-sample
loop.

Workloads: ``stack`` (forward; in a full run at 3/4 of the drawn lengths, max 192,
to fit the ``make bench`` budget: at N = 256 one padded forward takes ~10 s at one
thread) and ``stack/2`` (forward+backward w.r.t. the pair state and every
parameter, lengths halved: the padded backward of four blocks at N = 256 would
need about 18 GB). Systems:
``raggedfn`` and ``padded`` as in ``benchmarks.pairformer``, and ``loop``: the
padded model on one sample at a time (no padding at all). The ideal ratio is
``sum N^3 / (B * N_max^3)`` (the triangle updates dominate). ``torch.nested``
and danling are not systems here: a pair state has two ragged axes per sample,
which torch.nested's jagged layout refuses (REFERENCES.md).

Run: ``python -m benchmarks.run --only pairformer_stack``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks import pairformer
from benchmarks._systems import SizedSuite, lengths_by_workload
from benchmarks.harness import Case, Step, occupancy

BLOCKS = 4
# full: the forward stack at 3/4 of the drawn lengths (max 192; at 256 one padded
# forward costs ~10 s at 1 thread, which alone would take a third of `make bench`)
SIZES = {
    False: {"stack": (4, 0.75), "stack/2": (4, 0.5)},
    True: {"stack": (4, 0.25), "stack/2": (4, 0.25)},
}
MODE_OF = {"stack": "fwd", "stack/2": "fwd+bwd"}


def build_loop(case: Case) -> Step:
    """The padded model on one unpadded sample ``[1, N, N, C]`` at a time."""
    z, params, cotangent = pairformer._inputs(case)
    samples = [t.clone().unsqueeze(0) for t in raggedfn.unbind(z)]
    cots = [t.unsqueeze(0) for t in raggedfn.unbind(z.with_values(cotangent))]
    full = [torch.tensor([t.shape[1]]) for t in samples]

    def forward() -> list[Tensor]:
        return [pairformer.padded_model(t, n, params) for t, n in zip(samples, full, strict=True)]

    if case.mode == "fwd":

        def run() -> Any:
            with torch.no_grad():
                return forward()

    else:
        leaves = pairformer._leaves(params)
        for t in samples:
            t.requires_grad_(True)

        def run() -> Any:
            out = forward()
            torch.autograd.grad(out, [*samples, *leaves], cots)
            return out

    return Step(run, lambda out: [t[0].detach() for t in out])


SUITE = SizedSuite(
    name="pairformer_stack",
    workloads=list(MODE_OF),
    modes=["fwd", "fwd+bwd"],
    systems={
        "padded": pairformer.build_padded,
        "raggedfn": pairformer.build_ragged,
        "loop": build_loop,
    },
    params=lambda quick: {
        "blocks": BLOCKS,
        "blocks_fwd_bwd": BLOCKS,
        "channels": pairformer.CHANNELS,
        "heads": pairformer.HEADS,
        "sizes": SIZES[quick],
        "quick": quick,
        "lengths": lengths_by_workload(SIZES[quick], ["pair_low", "pair_high"]),
    },
    distributions=lambda quick: ["pair_low", "pair_high"],
    ideal_ratio=lambda case: occupancy(case.lengths, 3),
    # the memory target is on the high-variation batch (a padded run at N = 192 is ~4 s)
    memory_for=lambda case: not case.params["quick"] and case.distribution == "pair_high",
    sizes=lambda quick: SIZES[quick],
    runs=lambda case: MODE_OF[case.workload] == case.mode,
)
