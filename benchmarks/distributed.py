"""Token-budget batches and ragged collectives: ``python -m benchmarks.distributed [--quick]``.

Two measurements, written to ``benchmarks/results/distributed/distributed[-quick].json`` with a
markdown table next to it (and a PNG plot when matplotlib is installed):

- ``TokenBudgetBatchSampler`` on 100k lognormal lengths (the harness's
  ``lognormal``: mean 128, clipped to [16, 512]): batch fill (tokens / max_tokens),
  the spread of the ranks' token totals ((max - min) / max) and the time to plan
  one epoch, for several budgets and replica counts.
- ``raggedfn.distributed.all_to_all`` of a ragged batch against one
  ``torch.distributed.all_to_all_single`` moving the same bytes with the split
  sizes known in advance (what a hand-written exchange costs), for payloads of
  1 KiB to 100 MiB per rank, on 2 gloo processes (``torch.multiprocessing.spawn``,
  file rendezvous), one thread each. Beside them, the floor of any exchange that
  sends sizes first: one ``all_to_all_single`` of the header alone (and of 8
  bytes), and ``all_to_all`` given the receive sizes (``output_splits``,
  ``output_sizes``: no header). Rounds rotate which call runs first; times are
  medians, ratios the medians of per-round ratios. Target: within 1.2x.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
from raggedfn.distributed import _collectives

# a folder of its own: benchmarks/results/*.json are harness suite records
RESULTS = Path(__file__).resolve().parent / "results" / "distributed"
WORLD = 2
TARGET = 1.2
DIM = 64  # float32 values [T, 64]: 256 bytes per packed row


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


def _batch(rank: int, nbytes: int, dim: int) -> raggedfn.Ragged:
    """``nbytes`` of float32 ``[T, dim]`` values in lognormal-length samples (at least 2)."""
    rows = max(2, nbytes // (4 * dim))
    lengths, total = [], 0
    for n in lognormal_lengths(rows // 16 + 2, seed=10 + rank).tolist():  # lengths >= 16
        take = min(n, rows - total)
        if take == 0:
            break
        lengths.append(take)
        total += take
    if len(lengths) == 1:
        lengths = [rows // 2, rows - rows // 2]
    values = torch.randn(rows, dim, generator=torch.Generator().manual_seed(rank))
    return raggedfn.from_lengths(values, torch.tensor(lengths))


def _timed(calls: dict[str, Any], rounds: int) -> list[dict[str, float]]:
    """Each round times one call of each (ms), each call started by a barrier so that
    both ranks enter it together; rounds rotate who goes first, round 0 warms up."""
    names = list(calls)
    per_round: list[dict[str, float]] = []
    for r in range(rounds + 1):
        now: dict[str, float] = {}
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            started = time.perf_counter()
            calls[name]()
            now[name] = 1e3 * (time.perf_counter() - started)
        if r > 0:
            per_round.append(now)
    return per_round


def _measure(case: dict, rank: int) -> dict:
    x = _batch(rank, case["bytes"], DIM)
    splits = [x.batch_size // 2, x.batch_size - x.batch_size // 2]
    # the hand-written exchange: row counts known in advance (no size exchange)
    cut = int(x.offsets[splits[0]])
    rows_to = [cut, x.values.shape[0] - cut]
    received = torch.empty(WORLD, dtype=torch.int64)
    dist.all_to_all_single(received, torch.tensor(rows_to))
    rows_from = received.tolist()
    # what the ragged exchange receives, for the variant given the receive sizes
    got = raggedfn.distributed.all_to_all(x, splits)
    samples_from = torch.empty(WORLD, dtype=torch.int64)
    dist.all_to_all_single(samples_from, torch.tensor(splits))
    # the first call's message: the header all_to_all sends (its size is fixed)
    header = torch.zeros(WORLD, _collectives._META + max(8, _collectives._INLINE_SIZES // WORLD))
    header = header.to(torch.int64)
    tiny = torch.zeros(WORLD, dtype=torch.int64)  # 8 bytes to each rank

    def single() -> Any:
        out = x.values.new_empty((sum(rows_from), x.values.shape[1]))
        dist.all_to_all_single(out, x.values, rows_from, rows_to)
        return out

    def ragged() -> Any:
        return raggedfn.distributed.all_to_all(x, splits)

    def known() -> Any:
        return raggedfn.distributed.all_to_all(
            x, splits, output_splits=samples_from, output_sizes=got.sizes
        )

    def sizes_only() -> Any:
        out = torch.empty_like(header)
        dist.all_to_all_single(out, header)
        return out

    def smallest() -> Any:
        out = torch.empty_like(tiny)
        dist.all_to_all_single(out, tiny)
        return out

    assert torch.equal(ragged().values, single()), "all_to_all and all_to_all_single disagree"
    assert torch.equal(known().values, single()), "known-size all_to_all disagrees"
    calls = {
        "single": single,
        "ragged": ragged,
        "known": known,
        "header": sizes_only,
        "tiny": smallest,
    }
    per_round = _timed(calls, case["rounds"])
    times = {name: statistics.median(t[name] for t in per_round) for name in calls}

    def ratio(f: Any) -> float:
        return statistics.median(f(t) / t["single"] for t in per_round)

    return {
        **case,
        "dim": DIM,
        "samples": x.batch_size,
        "bytes_per_rank": x.values.numel() * x.values.element_size(),
        "header_bytes_per_rank": header.numel() * header.element_size(),
        **{f"{name}_ms": ms for name, ms in times.items()},
        "ratio": ratio(lambda t: t["ragged"]),
        "known_ratio": ratio(lambda t: t["known"]),
        "floor_ratio": ratio(lambda t: t["header"] + t["single"]),
    }


def _worker(rank: int, init_file: str, out_file: str, cases: list[dict]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=300),
    )
    results = [_measure(case, rank) for case in cases]
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def collective_rows(cases: list[dict]) -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "out.json")
        mp.spawn(
            _worker,
            args=(os.path.join(directory, "rendezvous"), out, cases),
            nprocs=WORLD,
        )
        rows: list[dict] = json.loads(Path(out).read_text())
        return rows


def cpu_rows(
    batches: Sequence[int] = (2, 64, 1024), rounds: int = 7, number: int = 200
) -> list[dict]:
    """Main-thread CPU microseconds per call (``time.thread_time``, medians over rounds) in a
    1-process gloo group: what our Python costs, free of the other rank's scheduling. The
    payload is small (16 rows of ``DIM`` floats per sample); each call exchanges it with
    this rank itself."""
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group(
            "gloo", init_method=f"file://{directory}/rendezvous", rank=0, world_size=1
        )
        try:
            for batch in batches:
                x = raggedfn.from_lengths(torch.randn(16 * batch, DIM), torch.full((batch,), 16))
                xg = x.with_values(x.values.clone().requires_grad_())
                rows_all = [x.values.shape[0]]
                header = torch.zeros(1, _collectives._META + _collectives._INLINE_SIZES)
                header = header.to(torch.int64)

                def single(x: raggedfn.Ragged = x, rows_all: list[int] = rows_all) -> None:
                    out = x.values.new_empty(x.values.shape)
                    dist.all_to_all_single(out, x.values, rows_all, rows_all)

                def two(header: torch.Tensor = header, single: Any = single) -> None:
                    dist.all_to_all_single(torch.empty_like(header), header)
                    single()

                a2a = raggedfn.distributed.all_to_all
                calls = {
                    "single": single,
                    "two": two,
                    "all_to_all": functools.partial(a2a, x, [batch]),
                    "all_to_all_grad": functools.partial(a2a, xg, [batch]),
                    "known": functools.partial(
                        a2a, x, [batch], output_splits=[batch], output_sizes=x.sizes
                    ),
                    "all_gather": functools.partial(raggedfn.distributed.all_gather, x),
                }
                times: dict[str, list[float]] = {name: [] for name in calls}
                for r in range(rounds + 1):  # round 0 warms up
                    for name, call in calls.items():
                        started = time.thread_time()
                        for _ in range(number):
                            call()
                        if r > 0:
                            times[name].append(1e6 * (time.thread_time() - started) / number)
                rows.append(
                    {
                        "samples": batch,
                        **{f"{k}_us": statistics.median(v) for k, v in times.items()},
                    }
                )
        finally:
            dist.destroy_process_group()
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
    lines += ["", collectives_markdown(record["collectives"])]
    if record.get("cpu"):
        lines += ["", cpu_markdown(record["cpu"])]
    return "\n".join(lines) + "\n"


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def collectives_markdown(rows: list[dict]) -> str:
    header_bytes = rows[0]["header_bytes_per_rank"] if rows else 0
    lines = [
        f"all_to_all of a ragged batch vs all_to_all_single of the same bytes ({WORLD} gloo "
        f"processes, 1 thread each, float32 [T, {DIM}], lognormal lengths, half the samples "
        f"to each rank; each call timed alone after a barrier, times are medians over rounds, ratios medians of per-round ratios; target within "
        f"{TARGET}x). *header*: one all_to_all_single of the header alone ({_size(header_bytes)} "
        f"per rank: what the sizes exchange sends); *8 B*: one of 8 bytes to each rank; floor: "
        f"(header + payload) / payload; *known sizes*: all_to_all given output_splits and "
        f"output_sizes (one collective).",
        "",
        "| payload per rank | samples | 8 B (ms) | header (ms) | payload (ms) | all_to_all (ms) "
        "| ratio | floor | known sizes (ms) | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {_size(row['bytes_per_rank'])} | {row['samples']} | {row['tiny_ms']:.3f} | "
            f"{row['header_ms']:.3f} | {row['single_ms']:.3f} | {row['ragged_ms']:.3f} | "
            f"{row['ratio']:.2f}x | {row['floor_ratio']:.2f}x | {row['known_ms']:.3f} | "
            f"{row['known_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def cpu_markdown(rows: list[dict]) -> str:
    lines = [
        "Main-thread CPU per call (us; 1-process gloo group, 16-row samples, medians): "
        "our Python around the collectives, without the other rank's scheduling.",
        "",
        "| samples | all_to_all_single | header + payload | all_to_all | all_to_all, values "
        "requiring grad | all_to_all given sizes | all_gather |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['samples']} | {row['single_us']:.0f} | {row['two_us']:.0f} | "
            f"{row['all_to_all_us']:.0f} | {row['all_to_all_grad_us']:.0f} | "
            f"{row['known_us']:.0f} | {row['all_gather_us']:.0f} |"
        )
    return "\n".join(lines)


def write_plot(record: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = record["collectives"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    sizes = [r["bytes_per_rank"] for r in rows]
    ax.plot(sizes, [r["ratio"] for r in rows], "o-", label="all_to_all")
    ax.plot(sizes, [r["floor_ratio"] for r in rows], "s--", label="floor: (header + payload)")
    ax.plot(sizes, [r["known_ratio"] for r in rows], "^-", label="given output sizes")
    ax.axhline(TARGET, color="red", linestyle=":", label=f"target {TARGET}x")
    ax.set_xscale("log", base=2)
    ax.set_ylabel("time / all_to_all_single")
    ax.set_xlabel("payload bytes per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# payload bytes per rank: 1 KiB to 100 MiB
SIZES = (*(2**k for k in range(10, 27, 2)), 100 * 2**20)


def _case(nbytes: int, quick: bool) -> dict:
    """Rounds: many for small payloads (their times are noisy), a few for large ones."""
    rounds = max(15, min(300, 2**28 // nbytes)) // (3 if quick else 1)
    return {"bytes": nbytes, "rounds": rounds}


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
    sizes = (2**10, 2**14, 2**18, 2**22, 100 * 2**20) if args.quick else SIZES
    cases = [_case(nbytes, args.quick) for nbytes in sizes]
    collectives = collective_rows(cases)
    cpu = cpu_rows(rounds=3 if args.quick else 7)
    record = {
        "suite": "distributed",
        "quick": args.quick,
        "machine": machine(),
        "torch": torch.__version__,
        "threads": 1,
        "sampler": sampler,
        "collectives": collectives,
        "cpu": cpu,
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
