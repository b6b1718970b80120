"""BERT layers at the issue's full lengths: raggedfn vs padded, eager or compiled.

``make bench`` runs the BERT suite at a quarter of the issue's lengths to fit its
time budget (``benchmarks/bert.py``). This script measures the issue's own
distribution, lognormal lengths with mean 128 clipped to [16, 512] (harness
distribution ``lognormal``, seed 30), B = 16, forward+backward. Each round runs
raggedfn and padded back to back in this process; the reported speedup is the
median of the per-round ratios. One thread by default.

Run: ``python -m benchmarks.bert_full [--scale tiny --scale mini ...] [--compiled]
[--rounds 3] [--threads 1]``; prints one markdown row per scale.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

import raggedfn
from benchmarks import bert, harness

SCALES = {"tiny": (2, 128, 2), "mini": (4, 256, 4), "small": (4, 512, 8), "base": (12, 768, 12)}


def systems(scale: str, lengths: Tensor, compiled: bool) -> dict[str, Callable[[Tensor], Tensor]]:
    layers, dim, heads = SCALES[scale]
    params = bert.make_params(layers, dim, torch.Generator().manual_seed(0), torch.float32)
    per_layer = [bert.layer_params(params, i) for i in range(layers)]
    ragged_layer: Callable[..., raggedfn.Ragged] = bert.layer_ragged
    padded_layer: Callable[..., Tensor] = bert.layer_batched
    if compiled:
        ragged_layer = torch.compile(bert.layer_ragged, fullgraph=True)
        padded_layer = torch.compile(bert.layer_batched, fullgraph=True)
    batch, longest = lengths.shape[0], int(lengths.max())
    mask = (torch.arange(longest) < lengths[:, None]).view(batch, 1, 1, longest)

    def ragged(values: Tensor) -> Tensor:
        x = raggedfn.from_lengths(values, lengths)
        raggedfn.mark_dynamic(x)
        for p in per_layer:
            x = ragged_layer(x, p, heads)
        return x.values

    def padded(values: Tensor) -> Tensor:
        t = raggedfn.to_padded(raggedfn.from_lengths(values, lengths))
        for p in per_layer:
            t = padded_layer(t, p, heads, mask)
        return t

    return {"raggedfn": ragged, "padded": padded}


def check_agreement(
    fns: dict[str, Callable[[Tensor], Tensor]], values: Tensor, lengths: Tensor
) -> None:
    """raggedfn's output equals padded's at the real positions."""
    with torch.no_grad():
        ragged = fns["raggedfn"](values)
        padded = fns["padded"](values)
    mask = torch.arange(padded.shape[1]) < lengths[:, None]
    torch.testing.assert_close(ragged, padded[mask], rtol=1e-3, atol=1e-3)


def step(fn: Callable[[Tensor], Tensor], values: Tensor) -> float:
    leaf = values.clone().requires_grad_(True)
    start = time.perf_counter()
    fn(leaf).square().sum().backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", action="append", choices=list(SCALES))
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*should not be instantiated")
    torch.set_num_threads(args.threads)
    dist = harness.DISTRIBUTIONS["lognormal"]
    lengths = torch.tensor(dist.lengths(args.batch, 1.0))
    total, longest = int(lengths.sum()), int(lengths.max())
    print(
        f"lognormal (seed {dist.seed}): B = {args.batch}, mean length {total / args.batch:.1f}, "
        f"max {longest}, occupancy {total / (args.batch * longest):.3f}; "
        f"{'compiled' if args.compiled else 'eager'} fwd+bwd, {args.threads} thread(s), "
        f"median of {args.rounds} rounds"
    )
    print("| scale | padded ms | raggedfn ms | speedup (median of per-round ratios) |")
    print("|---|---|---|---|")
    values = torch.randn(total, 1)
    for scale in args.scale or list(SCALES):
        dim = SCALES[scale][1]
        values = torch.randn(total, dim, generator=torch.Generator().manual_seed(1))
        fns = systems(scale, lengths, args.compiled)
        check_agreement(fns, values, lengths)  # never time a wrong computation
        for fn in fns.values():  # warm-up (and compile)
            step(fn, values)
        times: dict[str, list[float]] = {name: [] for name in fns}
        ratios = []
        for _ in range(args.rounds):
            row = {name: step(fn, values) for name, fn in fns.items()}
            for name, seconds in row.items():
                times[name].append(seconds)
            ratios.append(row["padded"] / row["raggedfn"])
        padded_ms = statistics.median(times["padded"]) * 1e3
        ragged_ms = statistics.median(times["raggedfn"]) * 1e3
        print(
            f"| {scale} | {padded_ms:.0f} | {ragged_ms:.0f} | {statistics.median(ratios):.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
