"""Mixture-of-experts expert layer: ``group_by`` + ``segment_matmul`` vs what users write.

The layer: every token ``t`` goes to one expert ``e_t`` (top-1 routing, skewed: expert
``e`` gets a share proportional to ``1 / (e + 1)``), ``y_t = x_t @ W[e_t] + b[e_t]``,
results in token order. Defaults: ``T = 8192`` tokens, 8 experts, ``K = F = 256``,
float32, one thread; forward, and forward+backward (gradients of ``x``, ``W`` and ``b``
for a fixed cotangent).

Systems, each checked against ``loop`` before timing:

- ``raggedfn``: ``grouped, order = raggedfn.group_by(x, ids, E)``,
  ``raggedfn.segment_matmul(grouped, W, b)``, then ``index_copy`` back by ``order``:
  one GEMM per non-empty expert, forward and backward.
- ``loop``: the per-expert loop of Hugging Face's Mixtral/Qwen MoE blocks:
  ``idx = (ids == e).nonzero()``, ``x[idx] @ W[e] + b[e]``, ``index_add_`` into the
  output.
- ``padded``: a capacity-padded ``[E, capacity, K]`` buffer (capacity = the busiest
  expert's tokens, so nothing is dropped), one ``bmm`` with ``W``, gathered back.

(A per-token gather of weights, ``bmm(x[:, None], W[ids])``, would hold a
``[T, K, F]`` tensor, 2 GiB here; it is not run.)

Each round runs every system once, back to back, in a rotating order; ratios are
medians of per-round ratios. Run: ``python -m benchmarks.moe [--tokens 8192]
[--experts 8] [--dim 256] [--rounds 15] [--threads 1] [--json PATH] [--markdown PATH]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks import plots
from benchmarks._standalone import cli, header, rotated_rounds

Params = dict[str, Tensor]


def routing(tokens: int, experts: int, seed: int = 0) -> Tensor:
    """Top-1 expert ids with shares proportional to ``1 / (e + 1)`` (expert 0 busiest)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    return torch.multinomial(weights / weights.sum(), tokens, replacement=True, generator=gen)


def make_inputs(
    tokens: int, experts: int, dim: int, seed: int = 0
) -> tuple[Tensor, Tensor, Params]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, dim, generator=gen)
    params = {
        "weight": torch.randn(experts, dim, dim, generator=gen) / dim**0.5,
        "bias": 0.1 * torch.randn(experts, dim, generator=gen),
    }
    return x, routing(tokens, experts, seed), params


def grouped(x: Tensor, ids: Tensor, p: Params) -> Tensor:
    groups, order = raggedfn.group_by(x, ids, p["weight"].shape[0])
    y = raggedfn.segment_matmul(groups, p["weight"], p["bias"]).values
    return y.new_empty(y.shape).index_copy(0, order, y)


def loop(x: Tensor, ids: Tensor, p: Params) -> Tensor:
    out = x.new_zeros(x.shape[0], p["weight"].shape[2])
    for e in range(p["weight"].shape[0]):
        idx = (ids == e).nonzero().squeeze(1)
        if idx.numel():
            out.index_add_(0, idx, x[idx] @ p["weight"][e] + p["bias"][e])
    return out


def padded(x: Tensor, ids: Tensor, p: Params) -> Tensor:
    experts = p["weight"].shape[0]
    order = torch.sort(ids, stable=True).indices
    counts = torch.bincount(ids, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    sorted_ids = ids[order]
    slot = torch.arange(x.shape[0]) - starts[sorted_ids]  # position inside the expert
    capacity = int(counts.max())
    buffer = x.new_zeros(experts, capacity, x.shape[1]).index_put((sorted_ids, slot), x[order])
    out = torch.bmm(buffer, p["weight"]) + p["bias"][:, None]
    y = out[sorted_ids, slot]
    return y.new_empty(y.shape).index_copy(0, order, y)


SYSTEMS: dict[str, Callable[[Tensor, Tensor, Params], Tensor]] = {
    "loop": loop,
    "padded": padded,
    "raggedfn": grouped,
}


def step(
    fn: Callable[[Tensor, Tensor, Params], Tensor],
    x: Tensor,
    ids: Tensor,
    p: Params,
    cotangent: Tensor | None,
) -> tuple[float, Any]:
    """Seconds of one forward (``cotangent`` None) or forward+backward; and the result."""
    start = time.perf_counter()
    if cotangent is None:
        with torch.no_grad():
            out: Any = fn(x, ids, p)
    else:
        xs = x.requires_grad_(True)
        out = torch.autograd.grad(fn(xs, ids, p), [xs, *p.values()], cotangent)
    return time.perf_counter() - start, out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    x, ids, p = make_inputs(args.tokens, args.experts, args.dim)
    for t in p.values():
        t.requires_grad_(True)
    cotangent = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(9))
    counts = torch.bincount(ids, minlength=args.experts)
    record: dict[str, Any] = {
        **header("moe", args),
        "tokens": args.tokens,
        "experts": args.experts,
        "dim": args.dim,
        "tokens_per_expert": counts.tolist(),
        "padded_occupancy": float(counts.sum()) / (args.experts * int(counts.max())),
        "rounds": args.rounds,
        "modes": {},
    }
    for mode, cot in (("fwd", None), ("fwd+bwd", cotangent)):
        # agreement first: never time a wrong computation
        results = {name: step(fn, x.detach(), ids, p, cot)[1] for name, fn in SYSTEMS.items()}
        want = results["loop"]
        for name, got in results.items():
            pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
            for g, w in pairs:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{mode} {name}")
        runs = {
            name: (lambda fn=fn, cot=cot: step(fn, x.detach(), ids, p, cot)[0])
            for name, fn in SYSTEMS.items()
        }
        record["modes"][mode] = rotated_rounds(runs, args.rounds)
    return record


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"MoE expert layer, T = {record['tokens']} tokens, {record['experts']} experts, "
        f"K = F = {record['dim']}, float32, top-1 routing skewed 1/(e+1): tokens per expert "
        f"{record['tokens_per_expert']} (padded buffer {record['padded_occupancy']:.2f} "
        f"occupied), {record['threads']} thread(s), median of {record['rounds']} rounds",
        "",
        "| mode | raggedfn ms | loop ms | padded bmm ms | raggedfn / loop | raggedfn / padded |",
        "|---|---|---|---|---|---|",
    ]
    for mode, cells in record["modes"].items():
        ms, over = cells["median_ms"], cells["raggedfn_over"]
        lines.append(
            f"| {mode} | {ms['raggedfn']:.1f} | {ms['loop']:.1f} | {ms['padded']:.1f} | "
            f"{over['loop']:.2f} | {over['padded']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    return cli(parser, run, markdown, argv, plot=plots.plot_moe)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
