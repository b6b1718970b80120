"""Ragged attention suite (issue #4): self-attention over a token batch, BERT-like shapes.

B = 32 sequences, lognormal lengths (mean 128, max 512, ~25% occupancy: harness
distribution ``lognormal``), Dh = 64, H = 4 and 12 heads, float32, forward and
forward+backward (gradients w.r.t. q, k and v with a fixed random cotangent).

Systems:

- ``raggedfn``: ``raggedfn.attention(q, k, v)`` on ``(B, N*, H, Dh)`` values;
- ``padded``: ``scaled_dot_product_attention`` on zero-padded ``[B, H, N_max, Dh]``
  with a boolean key mask ``[B, 1, 1, N_max]`` (inputs padded outside the timing);
- ``loop``: SDPA per sample on contiguous ``[1, H, N_i, Dh]`` tensors.

Run: ``python -m benchmarks.attention [--quick] [--threads 1]``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import raggedfn
from benchmarks import harness
from benchmarks.harness import Case, Step, Suite, occupancy

HEAD_DIM = 64


def _inputs(case: Case) -> tuple[list[Tensor], Tensor, int]:
    heads = int(case.workload.removeprefix("h"))
    gen = torch.Generator().manual_seed(case.seed)
    total = sum(case.lengths)
    qkv = [torch.randn(total, heads, HEAD_DIM, generator=gen) for _ in range(3)]
    cotangent = torch.randn(total, heads, HEAD_DIM, generator=gen)
    return qkv, cotangent, heads


def build_ragged(case: Case) -> Step:
    qkv, cotangent, _ = _inputs(case)
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    if case.mode != "fwd":
        for t in qkv:
            t.requires_grad_(True)
    q, k, v = (raggedfn.from_lengths(t, lengths) for t in qkv)

    def run() -> Any:
        out = raggedfn.attention(q, k, v)
        if case.mode != "fwd":
            torch.autograd.grad(out.values, qkv, cotangent)
        return out

    return Step(run, lambda out: [t.detach() for t in raggedfn.unbind(out)])


def build_padded(case: Case) -> Step:
    qkv, cotangent, _ = _inputs(case)
    lengths = torch.tensor(case.lengths, dtype=torch.int64)
    padded = [
        raggedfn.to_padded(raggedfn.from_lengths(t, lengths)).transpose(1, 2).contiguous()
        for t in qkv
    ]
    grad_out = raggedfn.to_padded(raggedfn.from_lengths(cotangent, lengths)).transpose(1, 2)
    width = padded[0].shape[2]
    keep = (torch.arange(width)[None, :] < lengths[:, None]).view(len(lengths), 1, 1, width)
    if case.mode != "fwd":
        for t in padded:
            t.requires_grad_(True)

    def run() -> Any:
        out = F.scaled_dot_product_attention(*padded, attn_mask=keep)
        if case.mode != "fwd":
            torch.autograd.grad(out, padded, grad_out)
        return out

    def collect(out: Tensor) -> list[Tensor]:
        return [out[i, :, :n].transpose(0, 1).detach() for i, n in enumerate(case.lengths)]

    return Step(run, collect)


def build_loop(case: Case) -> Step:
    qkv, cotangent, _ = _inputs(case)
    split = [
        [s.transpose(0, 1).unsqueeze(0).contiguous() for s in t.split(list(case.lengths))]
        for t in qkv
    ]
    grads = [s.transpose(0, 1).unsqueeze(0) for s in cotangent.split(list(case.lengths))]
    leaves = [s for per in split for s in per]
    if case.mode != "fwd":
        for t in leaves:
            t.requires_grad_(True)

    def run() -> Any:
        outs = [F.scaled_dot_product_attention(q, k, v) for q, k, v in zip(*split, strict=True)]
        if case.mode != "fwd":
            torch.autograd.grad(outs, leaves, grads)
        return outs

    return Step(run, lambda outs: [o[0].transpose(0, 1).detach() for o in outs])


SUITE = Suite(
    name="attention",
    workloads=["h4", "h12"],
    modes=["fwd", "fwd+bwd"],
    systems={"padded": build_padded, "raggedfn": build_ragged, "loop": build_loop},
    params=lambda quick: {"batch": 32, "scale": 0.25 if quick else 1.0, "head_dim": HEAD_DIM},
    distributions=lambda quick: ["lognormal"],
    ideal_ratio=lambda case: occupancy(case.lengths, 2),
)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    record = harness.run_suite(
        SUITE,
        quick=args.quick,
        threads=args.threads,
        warmup=args.warmup,
        repeats=args.repeats,
        memory=not args.no_memory,
    )
    stem = "attention" + ("-quick" if args.quick else "")
    harness.write_json(record, args.out / f"{stem}.json")
    harness.write_markdown(record, args.out / f"{stem}.md")
    harness.write_plot(record, args.out / f"{stem}.png")
    print(harness.markdown_report(record))
    print(f"wrote {args.out / stem}.json/.md/.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
