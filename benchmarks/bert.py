"""BERT encoder suite (issue #6): full post-norm layers at four scales.

Scales (layers / hidden / heads, feed-forward 4x hidden): tiny 2/128/2, mini
4/256/4, small 4/512/8, base 12/768/12. A layer is self-attention (fused QKV
projection, scaled dot-product attention over the sample, output projection),
residual + layer norm, GELU MLP, residual + layer norm. Modes: ``fwd`` and
``fwd+bwd``, eager and compiled (torch.compile, inductor; ``raggedfn.mark_dynamic``
on the ragged input), on ``lognormal`` and ``equal`` (``fwd`` on ``lognormal`` only). ``fwd+bwd``
differentiates w.r.t. the input and every parameter with a fixed cotangent.

Systems (``benchmarks._systems``): ``raggedfn`` (hand-written with
``raggedfn.linear`` / ``attention`` / ``layer_norm`` / ``apply``), ``map``
(``raggedfn.map`` of the per-sample layer stack), ``padded`` (``[B, N_max, D]``
with a boolean key mask in SDPA), ``nested`` (``torch.nested`` jagged), ``danling``
(``NestedTensor``), ``loop`` (per-sample Python loop). Compiled modes run
raggedfn and padded compiled; the others say ``missing``.

Sizes: the 2-core CPU this suite is budgeted for cannot run BERT-base on B = 32
sequences of up to 512 tokens in minutes, so each scale has its own batch and
length scale (``SIZES``; lengths are the distribution's draws times the scale,
which keeps the occupancy). Run: ``python -m benchmarks.run --only bert``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import raggedfn
from benchmarks._systems import Model, Params, SizedSuite, lengths_by_workload, systems_for
from benchmarks.harness import Case
from raggedfn import Ragged

SCALES: dict[str, tuple[int, int, int]] = {  # layers, hidden, heads
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "base": (12, 768, 12),
}
# (batch, length scale) per scale: full and quick runs
SIZES = {
    False: {"tiny": (16, 0.25), "mini": (8, 0.125), "small": (8, 0.0625), "base": (4, 0.0625)},
    # quick: no BERT-base (its fwd+bwd costs ~3 s on 2 cores even at 30 tokens: 85M weights)
    True: {"tiny": (8, 0.125), "mini": (4, 0.125), "small": (4, 0.0625)},
}
PARTS = ("qkv", "o", "f1", "f2")


def make_params(layers: int, dim: int, gen: torch.Generator, dtype: torch.dtype) -> Params:
    """Flat ``{"<layer>.<name>": tensor}`` parameters, fixed by ``gen``."""

    def w(out: int, inp: int) -> Tensor:
        return torch.randn(out, inp, generator=gen, dtype=dtype) / math.sqrt(inp)

    def b(n: int) -> Tensor:
        return 0.02 * torch.randn(n, generator=gen, dtype=dtype)

    p: Params = {}
    for i in range(layers):
        p[f"{i}.qkv_w"], p[f"{i}.qkv_b"] = w(3 * dim, dim), b(3 * dim)
        p[f"{i}.o_w"], p[f"{i}.o_b"] = w(dim, dim), b(dim)
        p[f"{i}.ln1_w"], p[f"{i}.ln1_b"] = 1 + b(dim), b(dim)
        p[f"{i}.f1_w"], p[f"{i}.f1_b"] = w(4 * dim, dim), b(4 * dim)
        p[f"{i}.f2_w"], p[f"{i}.f2_b"] = w(dim, 4 * dim), b(dim)
        p[f"{i}.ln2_w"], p[f"{i}.ln2_b"] = 1 + b(dim), b(dim)
    return p


def layer_params(p: Params, i: int) -> Params:
    """Layer ``i``'s parameters with the ``"<i>."`` prefix dropped (what a layer reads)."""
    prefix = f"{i}."
    return {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}


def layer_sample(t: Tensor, p: Params, heads: int) -> Tensor:
    """One layer on one sample ``[N, D]``: ordinary torch code."""
    n, d = t.shape
    qkv = F.linear(t, p["qkv_w"], p["qkv_b"]).view(n, 3, heads, d // heads)
    q, k, v = qkv.permute(1, 2, 0, 3).unbind(0)  # [H, N, dh] each
    a = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, d)
    h = F.layer_norm(t + F.linear(a, p["o_w"], p["o_b"]), (d,), p["ln1_w"], p["ln1_b"])
    f = F.linear(F.gelu(F.linear(h, p["f1_w"], p["f1_b"])), p["f2_w"], p["f2_b"])
    return F.layer_norm(h + f, (d,), p["ln2_w"], p["ln2_b"])


def layer_ragged(x: Ragged, p: Params, heads: int) -> Ragged:
    """One layer on a ``(B, N*, D)`` batch with raggedfn's ops."""
    d = x.shape[-1]
    qkv = raggedfn.linear(x, p["qkv_w"], p["qkv_b"])
    split = qkv.values.view(-1, 3, heads, d // heads)
    # unbind, not three selects: its backward stacks the three gradients (one copy) where
    # each select's backward zero-fills a [T, 3, H, dh] buffer (6% of a tiny layer's step)
    q, k, v = (x.with_values(t) for t in split.unbind(1))  # (B, N*, H, dh)
    a = raggedfn.attention(q, k, v)
    a = x.with_values(a.values.reshape(-1, d))
    h = raggedfn.layer_norm(x + raggedfn.linear(a, p["o_w"], p["o_b"]), d, p["ln1_w"], p["ln1_b"])
    f = raggedfn.apply(F.gelu, raggedfn.linear(h, p["f1_w"], p["f1_b"]))
    f = raggedfn.linear(f, p["f2_w"], p["f2_b"])
    return raggedfn.layer_norm(h + f, d, p["ln2_w"], p["ln2_b"])


def layer_batched(x: Any, p: Params, heads: int, mask: Tensor | None) -> Any:
    """One layer on a batched ``[B, N, D]``-like tensor (padded, nested or danling).

    ``mask`` (``[B, 1, 1, N]``, True = attend) hides padded keys (None for the
    nested types, whose SDPA attends within each sample).
    """
    d = x.shape[-1]
    qkv = F.linear(x, p["qkv_w"], p["qkv_b"])
    parts = qkv.chunk(3, dim=-1)
    if x.is_nested:  # torch.nested's SDPA wants contiguous values before the transpose
        parts = tuple(t.contiguous() for t in parts)
    q, k, v = (t.unflatten(-1, (heads, d // heads)).transpose(1, 2) for t in parts)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(-2)
    h = F.layer_norm(x + F.linear(a, p["o_w"], p["o_b"]), (d,), p["ln1_w"], p["ln1_b"])
    f = F.linear(F.gelu(F.linear(h, p["f1_w"], p["f1_b"])), p["f2_w"], p["f2_b"])
    return F.layer_norm(h + f, (d,), p["ln2_w"], p["ln2_b"])


@cache
def model(scale: str) -> Model:
    """The BERT stack of ``scale`` written once per system (cached: compiled code is shared).

    Each system's stack is ``stack(layer)``: a loop over one layer function with that
    layer's parameters, so compiled systems compile one layer per scale and reuse it
    for every layer (regional compilation: the unrolled 12-layer base stack would
    take minutes to compile on 2 cores; see docs/benchmarks.md).
    """
    layers, dim, heads = SCALES[scale]

    def stack(layer: Callable[..., Any]) -> Callable[..., Any]:
        def run(x: Any, p: Params, *rest: Any) -> Any:
            for i in range(layers):
                x = layer(x, layer_params(p, i), heads, *rest)
            return x

        return run

    return Model(
        dim,
        lambda gen, dtype: make_params(layers, dim, gen, dtype),
        stack(layer_sample),
        stack(layer_ragged),
        stack(layer_batched),
        stack=stack,
        ragged_layer=layer_ragged,
        batched_layer=layer_batched,
    )


def ideal_ratio(case: Case) -> float:
    """Real/padded FLOPs: ``24 D^2`` per token (projections, MLP) + ``4 D N`` (attention)."""
    dim = SCALES[case.workload][1]
    top = max(case.lengths)

    def flops(n: int) -> float:
        return 24 * dim * dim * n + 4 * dim * n * n

    return sum(flops(n) for n in case.lengths) / (len(case.lengths) * flops(top))


COMPILED_ON = ("lognormal", "equal")


def runs(case: Case) -> bool:
    """Which (distribution, mode) cells a run measures (the 2-core time budget).

    Quick: eager ``fwd+bwd`` on ``lognormal`` and ``equal`` (no base). Full: eager and
    compiled ``fwd+bwd`` on both, eager and compiled ``fwd`` on ``lognormal``.
    """
    if case.params.get("quick"):
        return case.mode == "fwd+bwd"
    return case.mode.startswith("fwd+bwd") or case.distribution == "lognormal"


SUITE = SizedSuite(
    name="bert",
    workloads=list(SCALES),
    modes=["fwd", "fwd+bwd", "fwd compiled", "fwd+bwd compiled"],
    systems=systems_for(lambda case: model(case.workload)),
    params=lambda quick: {
        "quick": quick,
        "sizes": SIZES[quick],
        "scales": SCALES,
        "lengths": lengths_by_workload(SIZES[quick], COMPILED_ON),
    },
    distributions=lambda quick: list(COMPILED_ON),
    ideal_ratio=ideal_ratio,
    memory_for=lambda case: (
        not case.params["quick"] and case.mode == "fwd+bwd" and case.distribution == "lognormal"
    ),
    sizes=lambda quick: SIZES[quick],
    runs=runs,
)
