"""BERT layers at the issue's full lengths: raggedfn vs padded, eager or compiled.

``make bench`` runs the BERT suite at a quarter of the issue's lengths to fit its
time budget (``benchmarks/bert.py``). This script measures the issue's own
distribution, lognormal lengths with mean 128 clipped to [16, 512] (harness
distribution ``lognormal``, seed 30), B = 16, forward+backward. Each round runs
raggedfn and padded back to back in this process (which goes first alternating
from round to round, after a warm-up round); the reported speedup is the median of
the per-round ratios. One thread by default.

Run: ``python -m benchmarks.bert_full [--scale tiny --scale mini ...] [--compiled]
[--rounds 3] [--threads 1] [--json PATH [--markdown PATH]]``; prints one markdown row
per scale; with ``--json`` writes the record and its plot (``benchmarks/results/bert_full/``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks import bert, harness, plots
from benchmarks._standalone import cli, header, rotated_rounds

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


def ideal_speedup(dim: int, lengths: list[int]) -> float:
    """Padded over real FLOPs (``benchmarks/bert.py``'s ideal ratio, inverted)."""

    def flops(n: int) -> float:
        return 24 * dim * dim * n + 4 * dim * n * n

    return len(lengths) * flops(max(lengths)) / sum(flops(n) for n in lengths)


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message=".*should not be instantiated")
    torch.set_num_threads(args.threads)
    dist = harness.DISTRIBUTIONS["lognormal"]
    lengths = torch.tensor(dist.lengths(args.batch, 1.0))
    total, longest = int(lengths.sum()), int(lengths.max())
    record: dict[str, Any] = {
        **header("bert_full", args),
        "distribution": dist.name,
        "seed": dist.seed,
        "lengths": lengths.tolist(),
        "occupancy": total / (args.batch * longest),
        "compiled": args.compiled,
        "rounds": args.rounds,
        "scales": {},
    }
    for scale in args.scale or list(SCALES):
        dim = SCALES[scale][1]
        values = torch.randn(total, dim, generator=torch.Generator().manual_seed(1))
        fns = systems(scale, lengths, args.compiled)
        check_agreement(fns, values, lengths)  # never time a wrong computation
        # (rotated_rounds' first round warms up and compiles)
        runs = {name: (lambda fn=fn, v=values: step(fn, v)) for name, fn in fns.items()}
        cell = rotated_rounds(runs, args.rounds)
        cell["speedup"] = 1 / cell["raggedfn_over"]["padded"]
        cell["ideal_speedup"] = ideal_speedup(dim, record["lengths"])
        record["scales"][scale] = cell
        print(
            f"{scale}: padded {cell['median_ms']['padded']:.0f} ms, raggedfn "
            f"{cell['median_ms']['raggedfn']:.0f} ms, {cell['speedup']:.2f}x",
            flush=True,
        )
    return record


def markdown(record: dict[str, Any]) -> str:
    lengths = record["lengths"]
    batch, total = len(lengths), sum(lengths)
    lines = [
        f"{record['distribution']} (seed {record['seed']}): B = {batch}, mean length "
        f"{total / batch:.1f}, max {max(lengths)}, occupancy {record['occupancy']:.3f}; "
        f"{'compiled' if record['compiled'] else 'eager'} fwd+bwd, {record['threads']} "
        f"thread(s), median of {record['rounds']} rounds",
        "",
        "| scale | padded ms | raggedfn ms | ideal speedup "
        "| speedup (median of per-round ratios) |",
        "|---|---|---|---|---|",
    ]
    speedups = []
    for scale, cell in record["scales"].items():
        ms = cell["median_ms"]
        speedups.append(cell["speedup"])
        lines.append(
            f"| {scale} | {ms['padded']:.0f} | {ms['raggedfn']:.0f} "
            f"| {cell['ideal_speedup']:.2f}x | {cell['speedup']:.2f}x |"
        )
    if len(speedups) > 1:
        mean = statistics.geometric_mean(speedups)
        lines.append(f"| geometric mean | | | | {mean:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", action="append", choices=list(SCALES))
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    return cli(parser, run, markdown, argv, plot=plots.plot_bert_full)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
