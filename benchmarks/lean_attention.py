"""Pairformer fwd+bwd with and without the lean attention primitive (issue #4 memory target).

``raggedfn.attention`` sends a float bias that needs a gradient to
``raggedfn._prims.scaled_dot_product_attention`` (saves the row logsumexp, not
the softmax). This script measures the ``benchmarks.pairformer`` fwd+bwd case
(2 blocks) three ways: ``padded``, ``old`` (raggedfn with torch's SDPA, as
before the primitive: ``_attention._lean`` forced to False) and ``lean``.

- time: the three alternate round by round in one process (1 thread), medians
  of the per-round ratios;
- memory: each variant in a fresh interpreter, as the harness's
  ``measure_memory_here`` (growth of the peak RSS over one step, after a first
  step, with ``MALLOC_MMAP_THRESHOLD_=65536``).

Run: ``python -m benchmarks.lean_attention [--dist pair_high] [--rounds 3] [--no-padded]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, pairformer
from raggedfn.ops import _attention

VARIANTS = ("padded", "old", "lean")
_LEAN = _attention._lean


def _case(dist: str) -> harness.Case:
    return next(
        c for c in pairformer.SUITE.cases() if c.distribution == dist and c.mode == "fwd+bwd"
    )


def _use(variant: str) -> str:
    """Select the attention path of ``variant``; returns the harness system to build."""
    _attention._lean = (lambda bias: False) if variant == "old" else _LEAN  # type: ignore[assignment]
    return "padded" if variant == "padded" else "raggedfn"


def memory(dist: str, variant: str) -> float | None:
    """Peak RSS growth (MiB) of one step of ``variant``, in a fresh interpreter."""
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    command = [sys.executable, "-m", "benchmarks.lean_attention", "--measure", variant]
    done = subprocess.run(
        [*command, "--dist", dist], capture_output=True, text=True, cwd=root, env=env, check=False
    )
    try:
        return float(done.stdout.split()[-1])
    except (IndexError, ValueError):
        return None


def times(dist: str, rounds: int, variants: Sequence[str]) -> dict[str, list[float]]:
    case = _case(dist)
    steps: dict[str, Callable[[], Any]] = {}
    for variant in variants:
        system = _use(variant)
        steps[variant] = pairformer.SUITE.build(case, system).run

    def timed(variant: str) -> float:
        _use(variant)
        start = time.perf_counter()
        steps[variant]()
        return time.perf_counter() - start

    for variant in variants:
        timed(variant)  # warm-up
    out: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant in [*variants[r % len(variants) :], *variants[: r % len(variants)]]:
            out[variant].append(timed(variant))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lean_attention", description=__doc__
    )
    parser.add_argument("--dist", default="pair_high", choices=["pair_high", "pair_low"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-padded", action="store_true")
    parser.add_argument("--measure", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.measure:
        system = _use(args.measure)
        print(harness.measure_memory_here(pairformer.SUITE, _case(args.dist), system))
        return 0
    variants = [v for v in VARIANTS if not (args.no_padded and v == "padded")]
    mib = {v: memory(args.dist, v) for v in variants}
    seconds = times(args.dist, args.rounds, variants)
    print(f"{args.dist} fwd+bwd, lengths {_case(args.dist).lengths}, 1 thread")
    for v in variants:
        print(f"{v:>6}: median {statistics.median(seconds[v]):.3f} s, peak {mib[v]} MiB")
    pairs = [("lean", "old")] + ([("old", "padded"), ("lean", "padded")] if "padded" in mib else [])
    for a, b in pairs:
        ratio = statistics.median(x / y for x, y in zip(seconds[a], seconds[b], strict=True))
        ma, mb = mib[a], mib[b]
        memory_ratio = f"{ma / mb:.3f}" if ma is not None and mb else "n/a"
        print(f"{a}/{b}: time {ratio:.3f} (median per-round), memory {memory_ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
