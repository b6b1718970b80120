"""Token-budget batches and ragged collectives: ``python -m benchmarks.distributed [--quick]``.

Two measurements, written to ``benchmarks/results/distributed/distributed[-quick].json`` with a
markdown table next to it (and a PNG plot when matplotlib is installed):

- ``TokenBudgetBatchSampler`` on 100k lognormal lengths (the harness's
  ``lognormal``: mean 128, clipped to [16, 512]): batch fill (tokens / max_tokens),
  the spread of the ranks' token totals ((max - min) / max) and the time to plan
  one epoch, for several budgets and replica counts.
- ``raggedfn.distributed.all_to_all`` of a ragged batch against one
  ``torch.distributed.all_to_all_single`` moving the same bytes with the split
  sizes known in advance (what a hand-written exchange costs), on 2 gloo processes
  (``torch.multiprocessing.spawn``, file rendezvous), one thread each; rounds
  alternate which runs first; times are medians, the ratio is the median of the
  per-round ratios. Target: within 1.2x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import raggedfn
from benchmarks.harness import DISTRIBUTIONS, machine, write_json
from raggedfn.data._sampler import plan_batches

# a folder of its own: benchmarks/results/*.json are harness suite records
RESULTS = Path(__file__).resolve().parent / "results" / "distributed"
WORLD = 2
TARGET = 1.2


def lognormal_lengths(count: int, seed: int = 0) -> np.ndarray:
    d = DISTRIBUTIONS["lognormal"]
    rng = np.random.default_rng(seed)
    drawn = rng.lognormal(math.log(d.mean) - d.sigma**2 / 2, d.sigma, count)
    return np.clip(np.round(drawn), d.low, d.high).astype(np.int64)


def sampler_rows(count: int, budgets: Sequence[int], replicas: Sequence[int]) -> list[dict]:
    lengths = lognormal_lengths(count)
    rows = []
    for max_tokens in budgets:
        for num_replicas in replicas:
            started = time.perf_counter()
            per_rank = plan_batches(lengths, max_tokens, seed=(0, 0), num_replicas=num_replicas)
            seconds = time.perf_counter() - started
            totals = [[int(lengths[b].sum()) for b in batches] for batches in per_rank]
            fills = np.array([t for r in totals for t in r]) / max_tokens
            rank_tokens = [sum(r) for r in totals]
            rows.append(
                {
                    "samples": count,
                    "max_tokens": max_tokens,
                    "num_replicas": num_replicas,
                    "batches_per_rank": len(per_rank[0]),
                    "equal_batch_counts": len({len(b) for b in per_rank}) == 1,
                    "fill_mean": float(fills.mean()),
                    "fill_p5": float(np.percentile(fills, 5)),
                    "batches_below_90": int((fills < 0.9).sum()),
                    "rank_spread": (max(rank_tokens) - min(rank_tokens)) / max(rank_tokens),
                    "plan_seconds": seconds,
                }
            )
    return rows


# ----- collectives: 2 processes ---------------------------------------------------------


def _batch(rank: int, samples: int, dim: int) -> raggedfn.Ragged:
    lengths = lognormal_lengths(samples, seed=10 + rank).tolist()
    values = torch.randn(sum(lengths), dim, generator=torch.Generator().manual_seed(rank))
    return raggedfn.from_lengths(values, torch.tensor(lengths))


def _timed(calls: dict[str, Any], rounds: int, number: int) -> tuple[dict[str, float], float]:
    """Median ms of each call, and the median per-round ratio of the first to the second."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    ratios = []
    for r in range(rounds + 1):
        order = names if r % 2 == 0 else names[::-1]  # alternate who goes first
        now: dict[str, float] = {}
        for name in order:
            dist.barrier()
            started = time.perf_counter()
            for _ in range(number):
                calls[name]()
            now[name] = (time.perf_counter() - started) / number
        if r == 0:
            continue  # warm-up round
        for name in names:
            times[name].append(now[name])
        ratios.append(now[names[0]] / now[names[1]])
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}, statistics.median(
        ratios
    )


def _measure(case: dict, rank: int, rounds: int) -> dict:
    x = _batch(rank, case["samples"], case["dim"])
    splits = [x.batch_size // 2, x.batch_size - x.batch_size // 2]
    # the hand-written exchange: row counts known in advance (no size exchange)
    cut = int(x.offsets[splits[0]])
    rows_to = [cut, x.values.shape[0] - cut]
    received = torch.empty(WORLD, dtype=torch.int64)
    dist.all_to_all_single(received, torch.tensor(rows_to))
    rows_from = received.tolist()

    def ragged() -> Any:
        return raggedfn.distributed.all_to_all(x, splits)

    def single() -> Any:
        out = x.values.new_empty((sum(rows_from), x.values.shape[1]))
        dist.all_to_all_single(out, x.values, rows_from, rows_to)
        return out

    def latency() -> Any:  # one round trip with a 16-byte message per rank
        out = torch.empty(WORLD, dtype=torch.int64)
        dist.all_to_all_single(out, torch.zeros(WORLD, dtype=torch.int64))
        return out

    assert torch.equal(ragged().values, single()), "all_to_all and all_to_all_single disagree"
    times, ratio = _timed({"ragged": ragged, "single": single}, rounds, case["repeat"])
    floor, _ = _timed({"latency": latency, "single": single}, rounds, case["repeat"])
    return {
        **case,
        "bytes_per_rank": x.values.numel() * x.values.element_size(),
        "tokens_per_rank": int(x.values.shape[0]),
        "ragged_ms": times["ragged"],
        "single_ms": times["single"],
        "latency_ms": floor["latency"],
        "ratio": ratio,
        "rounds": rounds,
    }


def _worker(rank: int, init_file: str, out_file: str, cases: list[dict], rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=300),
    )
    results = [_measure(case, rank, rounds) for case in cases]
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def collective_rows(cases: list[dict], rounds: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "out.json")
        mp.spawn(
            _worker,
            args=(os.path.join(directory, "rendezvous"), out, cases, rounds),
            nprocs=WORLD,
        )
        rows: list[dict] = json.loads(Path(out).read_text())
        return rows


# ----- report ------------------------------------------------------------------------------


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"Sampler: {record['sampler'][0]['samples']} lognormal lengths (mean 128, [16, 512]).",
        "",
        "| max_tokens | ranks | batches per rank | fill mean | fill p5 | batches < 90% | "
        "rank token spread | plan (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in record["sampler"]:
        lines.append(
            f"| {row['max_tokens']} | {row['num_replicas']} | {row['batches_per_rank']} | "
            f"{row['fill_mean']:.4f} | {row['fill_p5']:.3f} | {row['batches_below_90']} | "
            f"{100 * row['rank_spread']:.2f}% | {row['plan_seconds']:.2f} |"
        )
    lines += [
        "",
        f"all_to_all of a ragged batch vs all_to_all_single of the same bytes "
        f"({WORLD} gloo processes, 1 thread each, float32, half the samples to each rank; "
        f"target within {TARGET}x):",
        "",
        "| samples per rank | D | MiB per rank | all_to_all (ms) | all_to_all_single (ms) | ratio "
        "| one round trip (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in record["collectives"]:
        lines.append(
            f"| {row['samples']} | {row['dim']} | {row['bytes_per_rank'] / 2**20:.2f} | "
            f"{row['ragged_ms']:.3f} | {row['single_ms']:.3f} | {row['ratio']:.2f}x | "
            f"{row['latency_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def write_plot(record: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = record["collectives"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['bytes_per_rank'] / 2**20:.2g} MiB" for r in rows]
    ax.bar(labels, [r["ratio"] for r in rows])
    ax.axhline(TARGET, color="red", linestyle="--", label=f"target {TARGET}x")
    ax.set_ylabel("all_to_all / all_to_all_single")
    ax.set_xlabel("values per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    sampler = sampler_rows(
        100_000,
        budgets=(4096,) if args.quick else (1024, 4096, 16384),
        replicas=(1, 8) if args.quick else (1, 8, 64),
    )
    cases = [
        {"samples": 8, "dim": 64, "repeat": 20},
        {"samples": 64, "dim": 256, "repeat": 5},
        {"samples": 256, "dim": 1024, "repeat": 1},
    ]
    collectives = collective_rows(cases[:2] if args.quick else cases, 5 if args.quick else 15)
    record = {
        "suite": "distributed",
        "quick": args.quick,
        "machine": machine(),
        "torch": torch.__version__,
        "threads": 1,
        "sampler": sampler,
        "collectives": collectives,
        "seconds": time.perf_counter() - started,
    }
    stem = "distributed-quick" if args.quick else "distributed"
    write_json(record, args.out / f"{stem}.json")
    (args.out / f"{stem}.md").write_text(markdown(record))
    write_plot(record, args.out / f"{stem}.png")
    print(markdown(record))
    print(f"total elapsed {record['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
