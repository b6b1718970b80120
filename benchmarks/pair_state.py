"""Pair-state block per sample: per-sample loop vs ``raggedfn.map`` vs padded (issue 18).

The block, per sample ``s [N, C]``::

    p = s[:, None] + s[None]                      # [N, N, C]
    p = p + linear(gelu(linear(p, W1, b1)), W2, b2)   # hidden [N, N, 4C]
    a = softmax(p.sum(-1), -1)                    # [N, N]
    return a @ s                                  # [N, C]

Systems: ``loop`` (the block per sample on views of the packed rows, one ``cat``),
``map`` (``raggedfn.map`` with its default chunking), ``map_whole`` (``chunk_elements=0``:
the whole batch at once), ``padded`` (masked dense batch). Method: one process, 1 thread,
every system's output checked against the loop's first, then rounds in which every
system runs once in a rotated order; a cell is the median over rounds and a ratio
``loop / system`` the median of the per-round ratios. Peak memory (``--memory``) is the
growth of the peak RSS while the step runs once more, each system in a fresh process.

Usage: ``nice -n 5 python -m benchmarks.pair_state --batch 8 32 --rounds 7 [--clock cpu]
[--memory] [--json benchmarks/results/pairs/pair_state.json]`` (the record, and its plot
next to it). ``--steady 4``: each system's calls back to back within a round, as a
training loop makes them (see :func:`run_case`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import raggedfn
from benchmarks import plots
from benchmarks.harness import machine

CHANNELS = 32
HIDDEN = 4 * CHANNELS
SYSTEMS = ("loop", "map", "map_tiles", "map_whole", "padded")
RECORD = Path(__file__).resolve().parent / "results" / "pairs" / "pair_state.json"


def lengths_for(batch: int, seed: int = 18) -> list[int]:
    """Lognormal lengths (mean 64, log-spread 0.7) clipped to [8, 192]."""
    rng = np.random.default_rng(seed + batch)
    sigma = 0.7
    drawn = rng.lognormal(np.log(64) - sigma**2 / 2, sigma, batch)
    return [int(n) for n in np.clip(np.round(drawn), 8, 192)]


def block(s: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    p = s[:, None] + s[None]
    p = p + F.linear(F.gelu(F.linear(p, w1, b1)), w2, b2)
    a = torch.softmax(p.sum(-1), -1)
    return a @ s


def padded_block(s: Tensor, mask: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    p = s[:, :, None] + s[:, None]
    p = p + F.linear(F.gelu(F.linear(p, w1, b1)), w2, b2)
    logits = p.sum(-1).masked_fill(~mask[:, None, :], float("-inf"))
    return torch.softmax(logits, -1) @ s


def make_inputs(batch: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch)
    lengths = lengths_for(batch)
    total = sum(lengths)
    values = torch.randn(total, CHANNELS, generator=gen, dtype=dtype)
    params = [
        torch.randn(HIDDEN, CHANNELS, generator=gen, dtype=dtype) / CHANNELS**0.5,
        torch.randn(HIDDEN, generator=gen, dtype=dtype) * 0.1,
        torch.randn(CHANNELS, HIDDEN, generator=gen, dtype=dtype) / HIDDEN**0.5,
        torch.randn(CHANNELS, generator=gen, dtype=dtype) * 0.1,
    ]
    cotangent = torch.randn(total, CHANNELS, generator=gen, dtype=dtype)
    return {"lengths": lengths, "values": values, "params": params, "cotangent": cotangent}


def build(system: str, inputs: dict[str, Any], backward: bool) -> Callable[[], Tensor]:
    """A step returning the packed ``[T, C]`` outputs (and running the backward)."""
    lengths: list[int] = inputs["lengths"]
    values = inputs["values"].clone().requires_grad_(backward)
    params = [p.clone().requires_grad_(backward) for p in inputs["params"]]
    cotangent = inputs["cotangent"]
    leaves = [values, *params]

    if system == "loop":

        def forward() -> Tensor:
            return torch.cat([block(s, *params) for s in values.split(lengths)])

    elif system in ("map", "map_tiles", "map_whole"):
        chunk = {
            "map": {},  # the default: groups of samples and row tiles
            "map_tiles": {"chunk_elements": 1 << 40},  # one group, row tiles
            "map_whole": {"chunk_elements": 0},  # the whole batch op by op
        }[system]
        lengths_t = torch.tensor(lengths)

        def forward() -> Tensor:
            x = raggedfn.from_lengths(values, lengths_t)
            out = raggedfn.map(block, x, *params, in_dims=(0, None, None, None, None), **chunk)
            return out.values

    elif system == "padded":
        lengths_t = torch.tensor(lengths)
        width = max(lengths)
        mask = torch.arange(width)[None] < lengths_t[:, None]
        flat = mask.flatten().nonzero().squeeze(1)

        def forward() -> Tensor:
            padded = values.new_zeros(len(lengths) * width, CHANNELS).index_copy(0, flat, values)
            out = padded_block(padded.view(len(lengths), width, CHANNELS), mask, *params)
            return out.reshape(-1, CHANNELS).index_select(0, flat)

    else:
        raise ValueError(system)

    if not backward:

        def step() -> Tensor:
            with torch.no_grad():
                return forward()

        return step

    def step_bwd() -> Tensor:
        out = forward()
        grads = torch.autograd.grad((out * cotangent).sum(), leaves)
        return torch.cat([out.detach().flatten(), *(g.flatten() for g in grads)])

    return step_bwd


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure_memory(system: str, batch: int, backward: bool) -> float:
    """Peak RSS growth (MiB) of one more step, in a fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    code = (
        "import torch, benchmarks.pair_state as b;"
        f"print(b._memory_child({system!r}, {batch}, {backward}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def _memory_child(system: str, batch: int, backward: bool) -> float:
    torch.set_num_threads(1)
    step = build(system, make_inputs(batch), backward)
    step()
    step()
    import gc

    gc.collect()
    before = _rss_mib()
    Path("/proc/self/clear_refs").write_text("5")
    step()
    return _peak_rss_mib() - before


def run_case(
    batch: int,
    backward: bool,
    systems: Sequence[str],
    rounds: int,
    clock: str = "wall",
    steady: int = 0,
) -> dict[str, Any]:
    """One batch size and mode: every system checked against the loop, then timed.

    ``steady``: in each round a system runs ``steady + 1`` times back to back, as a
    training loop calls its step, and the median of the last ``steady`` calls is the
    round's time (0: once per round, right after the previous system's call, so its
    time includes what that call left behind: freed memory the allocator returned to
    the system, caches full of another working set)."""
    inputs = make_inputs(batch)
    steps = {name: build(name, inputs, backward) for name in systems}
    reference = steps["loop"]()
    for name, step in steps.items():
        out = step()
        scale = reference.abs().max().item()
        if not torch.allclose(out, reference, rtol=1e-4, atol=1e-5 * scale):
            raise AssertionError(f"{name} disagrees with the loop: {(out - reference).abs().max()}")
        step()  # warm
    times: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    now = time.perf_counter if clock == "wall" else time.thread_time
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:  # backwards every other round: no system always follows the same one
            order.reverse()
        for name in order:
            if steady:
                steps[name]()  # the call after another system's: not timed
                calls = []
                for _ in range(steady):
                    start = now()
                    steps[name]()
                    calls.append(now() - start)
                times[name].append(statistics.median(calls))
                continue
            start = now()
            steps[name]()
            times[name].append(now() - start)
    lengths = inputs["lengths"]
    row: dict[str, Any] = {
        "batch": batch,
        "mode": "fwd+bwd" if backward else "fwd",
        "steady": steady,
        "mean_n": sum(lengths) / len(lengths),
        "max_n": max(lengths),
        "pairs": sum(n * n for n in lengths),
        "ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "loop_over": {
            n: statistics.median(a / b for a, b in zip(times["loop"], t, strict=True))
            for n, t in times.items()
        },
    }
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--mode", nargs="+", default=["fwd", "fwd+bwd"])
    parser.add_argument("--memory", action="store_true")
    parser.add_argument(
        "--steady", type=int, default=0, metavar="CALLS",
        help="time CALLS back-to-back calls of each system per round (after one untimed)",
    )  # fmt: skip
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the thread's CPU time (on a loaded machine wall time also counts waiting)",
    )
    parser.add_argument(
        "--json", type=Path, default=None,
        help="write the record here (and its plot next to it), e.g. " + str(RECORD),
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    systems = ["loop", *(s for s in args.systems if s != "loop")]
    rows = []
    print(
        "| B | mode | "
        + " | ".join(f"{s} ms" for s in systems)
        + " | "
        + " | ".join(f"loop/{s}" for s in systems[1:])
        + (" | " + " | ".join(f"{s} MiB" for s in systems) if args.memory else "")
        + " |"
    )
    for batch in args.batch:
        for mode in args.mode:
            backward = mode == "fwd+bwd"
            row = run_case(batch, backward, systems, args.rounds, args.clock, args.steady)
            if args.memory:
                row["mib"] = {s: measure_memory(s, batch, backward) for s in systems}
            rows.append(row)
            cells = [f"{row['ms'][s]:.1f}" for s in systems]
            cells += [f"{row['loop_over'][s]:.2f}x" for s in systems[1:]]
            if args.memory:
                cells += [f"{row['mib'][s]:.1f}" for s in systems]
            print(f"| {batch} | {mode} | " + " | ".join(cells) + " |", flush=True)
    if args.json is not None:
        record = {
            "command": " ".join(["python -m benchmarks.pair_state", *(argv or sys.argv[1:])]),
            "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__,
            "threads": 1,
            "clock": args.clock,
            "steady": args.steady,
            "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "machine": machine(),
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        plots.plot_pair_state(record, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
