"""Pairformer-style suite (issue #4): four blocks on pair states ``(B, N*, N*, C)``.

Each block, written once with raggedfn's public ops and once on padded tensors
with masks: triangle multiplicative update (outgoing ``'bikc,bjkc->bijc'`` and
incoming ``'bkic,bkjc->bijc'``), triangle attention with pair bias along rows
(``raggedfn.attention`` with two ragged axes), and a transition MLP. C = 32,
4 heads of 8, transition 4x. Lengths 32..256 in a low- and a high-variation
batch (registered as harness distributions ``pair_low`` / ``pair_high``).

Systems: ``raggedfn`` (pair states, no padding) and ``padded`` (``[B, N, N, C]``
zero-padded, pair mask on the triangle-update operands, key mask in the
attention). Forward+backward differentiates the output w.r.t. the input pair
state and every parameter with a fixed random cotangent.

Run: ``python -m benchmarks.pairformer [--quick] [--threads 1]`` (writes
``benchmarks/results/pairformer*.json/.md``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import raggedfn
from benchmarks import harness
from benchmarks.harness import Case, Distribution, Step, Suite, occupancy
from raggedfn import Ragged

CHANNELS = 32
HEADS = 4
BLOCKS = 4

for _dist in (
    Distribution("pair_low", 224, 0.08, 32, 256, 6, "pair states, low variation (32..256)"),
    Distribution("pair_high", 96, 0.8, 32, 256, 3, "pair states, high variation (32..256)"),
):
    harness.DISTRIBUTIONS.setdefault(_dist.name, _dist)


@dataclass
class Params:
    """One block's parameters (float tensors; a list of them is the model)."""

    tensors: dict[str, Tensor]

    def __getattr__(self, name: str) -> Tensor:
        try:
            return self.__dict__["tensors"][name]
        except KeyError as error:
            raise AttributeError(name) from error


def make_params(seed: int, channels: int = CHANNELS, blocks: int = BLOCKS) -> list[Params]:
    gen = torch.Generator().manual_seed(seed)
    c = channels

    def w(out: int, inp: int) -> Tensor:
        return torch.randn(out, inp, generator=gen) / math.sqrt(inp)

    out = []
    for _ in range(blocks):
        t: dict[str, Tensor] = {}
        for name in ("out", "in"):
            t[f"{name}_ln"] = 1 + 0.1 * torch.randn(c, generator=gen)
            for part in ("ag", "ap", "bg", "bp", "g", "o"):
                t[f"{name}_{part}"] = w(c, c)
            t[f"{name}_ln_o"] = 1 + 0.1 * torch.randn(c, generator=gen)
        t["att_ln"] = 1 + 0.1 * torch.randn(c, generator=gen)
        for part in ("q", "k", "v", "g", "o"):
            t[f"att_{part}"] = w(c, c)
        t["att_b"] = w(HEADS, c)
        t["tr_ln"] = 1 + 0.1 * torch.randn(c, generator=gen)
        t["tr_1"] = w(4 * c, c)
        t["tr_2"] = w(c, 4 * c)
        out.append(Params(t))
    return out


# ----- raggedfn ---------------------------------------------------------------------------


def _sigmoid(x: Ragged) -> Ragged:
    return raggedfn.apply(torch.sigmoid, x)


def ragged_triangle_update(z: Ragged, p: Params, name: str, equation: str) -> Ragged:
    c = z.shape[-1]
    zn = raggedfn.layer_norm(z, (c,), getattr(p, f"{name}_ln"))
    a = _sigmoid(raggedfn.linear(zn, getattr(p, f"{name}_ag"))) * raggedfn.linear(
        zn, getattr(p, f"{name}_ap")
    )
    b = _sigmoid(raggedfn.linear(zn, getattr(p, f"{name}_bg"))) * raggedfn.linear(
        zn, getattr(p, f"{name}_bp")
    )
    gate = _sigmoid(raggedfn.linear(zn, getattr(p, f"{name}_g")))
    x = raggedfn.einsum(equation, a, b)
    x = raggedfn.linear(
        raggedfn.layer_norm(x, (c,), getattr(p, f"{name}_ln_o")), getattr(p, f"{name}_o")
    )
    return z + gate * x


def ragged_triangle_attention(z: Ragged, p: Params) -> Ragged:
    c = z.shape[-1]
    zn = raggedfn.layer_norm(z, (c,), p.att_ln)
    q, k, v = (
        raggedfn.unflatten(raggedfn.linear(zn, w), -1, (HEADS, c // HEADS))
        for w in (p.att_q, p.att_k, p.att_v)
    )
    bias = raggedfn.linear(zn, p.att_b)  # (B, N*, N*, H): shared by every row
    out = raggedfn.flatten(raggedfn.attention(q, k, v, bias=bias), 3, 4)
    gate = _sigmoid(raggedfn.linear(zn, p.att_g))
    return z + raggedfn.linear(gate * out, p.att_o)


def ragged_transition(z: Ragged, p: Params) -> Ragged:
    c = z.shape[-1]
    zn = raggedfn.layer_norm(z, (c,), p.tr_ln)
    hidden = raggedfn.apply(torch.relu, raggedfn.linear(zn, p.tr_1))
    return z + raggedfn.linear(hidden, p.tr_2)


def ragged_block(z: Ragged, p: Params) -> Ragged:
    z = ragged_triangle_update(z, p, "out", "bikc,bjkc->bijc")
    z = ragged_triangle_update(z, p, "in", "bkic,bkjc->bijc")
    z = ragged_triangle_attention(z, p)
    return ragged_transition(z, p)


def ragged_model(z: Ragged, params: Sequence[Params]) -> Ragged:
    for p in params:
        z = ragged_block(z, p)
    return z


# ----- padded baseline --------------------------------------------------------------------


def padded_triangle_update(z: Tensor, mask: Tensor, p: Params, name: str, equation: str) -> Tensor:
    c = z.shape[-1]
    zn = F.layer_norm(z, (c,), getattr(p, f"{name}_ln"))
    keep = mask.unsqueeze(-1)
    a = (
        torch.sigmoid(F.linear(zn, getattr(p, f"{name}_ag")))
        * F.linear(zn, getattr(p, f"{name}_ap"))
        * keep
    )
    b = (
        torch.sigmoid(F.linear(zn, getattr(p, f"{name}_bg")))
        * F.linear(zn, getattr(p, f"{name}_bp"))
        * keep
    )
    gate = torch.sigmoid(F.linear(zn, getattr(p, f"{name}_g")))
    x = torch.einsum(equation, a, b)
    x = F.linear(F.layer_norm(x, (c,), getattr(p, f"{name}_ln_o")), getattr(p, f"{name}_o"))
    return z + gate * x


def padded_triangle_attention(z: Tensor, key_mask: Tensor, p: Params) -> Tensor:
    batch, n, _, c = z.shape
    dh = c // HEADS
    zn = F.layer_norm(z, (c,), p.att_ln)

    def heads(w: Tensor) -> Tensor:  # [B, i, j, C] -> [B * i, H, j, dh]
        return (
            F.linear(zn, w)
            .view(batch, n, n, HEADS, dh)
            .permute(0, 1, 3, 2, 4)
            .reshape(batch * n, HEADS, n, dh)
        )

    q, k, v = heads(p.att_q), heads(p.att_k), heads(p.att_v)
    bias = F.linear(zn, p.att_b).permute(0, 3, 1, 2)  # [B, H, j, k]
    bias = bias.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    bias = bias.unsqueeze(1).expand(batch, n, HEADS, n, n).reshape(batch * n, HEADS, n, n)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out = out.view(batch, n, HEADS, n, dh).permute(0, 1, 3, 2, 4).reshape(batch, n, n, c)
    gate = torch.sigmoid(F.linear(zn, p.att_g))
    return z + F.linear(gate * out, p.att_o)


def padded_transition(z: Tensor, p: Params) -> Tensor:
    c = z.shape[-1]
    zn = F.layer_norm(z, (c,), p.tr_ln)
    return z + F.linear(torch.relu(F.linear(zn, p.tr_1)), p.tr_2)


def padded_model(z: Tensor, lengths: Tensor, params: Sequence[Params]) -> Tensor:
    n = z.shape[1]
    key_mask = torch.arange(n)[None, :] < lengths[:, None]  # [B, N]
    mask = (key_mask[:, :, None] & key_mask[:, None, :]).to(z.dtype)
    for p in params:
        z = padded_triangle_update(z, mask, p, "out", "bikc,bjkc->bijc")
        z = padded_triangle_update(z, mask, p, "in", "bkic,bkjc->bijc")
        z = padded_triangle_attention(z, key_mask, p)
        z = padded_transition(z, p)
    return z


# ----- suite ------------------------------------------------------------------------------


def _inputs(case: Case) -> tuple[Ragged, list[Params], Tensor]:
    gen = torch.Generator().manual_seed(case.seed)
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    sizes = torch.stack([lengths, lengths], dim=1)
    total = int((lengths * lengths).sum())
    z = raggedfn.from_sizes(torch.randn(total, CHANNELS, generator=gen), sizes)
    blocks = case.params["blocks" if case.mode == "fwd" else "blocks_fwd_bwd"]
    params = make_params(case.seed + 1, blocks=blocks)
    cotangent = torch.randn(total, CHANNELS, generator=gen)
    return z, params, cotangent


def _leaves(params: Sequence[Params]) -> list[Tensor]:
    return [t.requires_grad_(True) for p in params for t in p.tensors.values()]


def build_ragged(case: Case) -> Step:
    z, params, cotangent = _inputs(case)
    if case.mode == "fwd":

        def run() -> Any:
            with torch.no_grad():
                return ragged_model(z, params)

    else:
        leaves = _leaves(params)
        z = Ragged(z.values.requires_grad_(True), z.offsets, z.sizes, z.layout)

        def run() -> Any:
            out = ragged_model(z, params)
            torch.autograd.grad(out.values, [z.values, *leaves], cotangent)
            return out

    return Step(run, lambda out: [t.detach() for t in raggedfn.unbind(out)])


def build_padded(case: Case) -> Step:
    z, params, cotangent = _inputs(case)
    lengths = z.sizes[:, 0]
    padded = raggedfn.to_padded(z)
    padded_cotangent = raggedfn.to_padded(z.with_values(cotangent))
    if case.mode == "fwd":

        def run() -> Any:
            with torch.no_grad():
                return padded_model(padded, lengths, params)

    else:
        leaves = _leaves(params)
        padded.requires_grad_(True)

        def run() -> Any:
            out = padded_model(padded, lengths, params)
            torch.autograd.grad(out, [padded, *leaves], padded_cotangent)
            return out

    def collect(out: Tensor) -> list[Tensor]:
        return [out[i, :n, :n].detach() for i, n in enumerate(lengths.tolist())]

    return Step(run, collect)


def _params(quick: bool) -> dict[str, Any]:
    # fwd+bwd runs 2 blocks: padded fwd+bwd needs ~4.5 GB per block at B = 4, N_max = 256
    return {
        "batch": 4,
        "blocks": 1 if quick else BLOCKS,
        "blocks_fwd_bwd": 1 if quick else 2,
        "scale": 0.25 if quick else 1.0,
        "channels": CHANNELS,
        "heads": HEADS,
    }


SUITE = Suite(
    name="pairformer",
    workloads=["pairformer"],
    modes=["fwd", "fwd+bwd"],
    systems={"padded": build_padded, "raggedfn": build_ragged},
    params=_params,
    distributions=lambda quick: ["pair_low", "pair_high"],
    ideal_ratio=lambda case: occupancy(case.lengths, 3),
)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.pairformer", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--dist", action="append", choices=["pair_low", "pair_high"], help="only these batches"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    suite = SUITE
    if args.dist:
        suite = dataclasses.replace(SUITE, distributions=lambda quick: list(args.dist))
    record = harness.run_suite(
        suite,
        quick=args.quick,
        threads=args.threads,
        warmup=args.warmup,
        repeats=args.repeats,
        memory=not args.no_memory,
    )
    stem = (
        "pairformer" + ("-quick" if args.quick else "") + "".join(f"-{d}" for d in args.dist or [])
    )
    harness.write_json(record, args.out / f"{stem}.json")
    harness.write_markdown(record, args.out / f"{stem}.md")
    harness.write_plot(record, args.out / f"{stem}.png")
    print(harness.markdown_report(record))
    print(f"wrote {args.out / stem}.json/.md/.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
