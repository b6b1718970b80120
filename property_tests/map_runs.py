"""The seed of a run of generated programs, and a run split over processes.

``program_seed()`` is the seed ``make test`` checks its 2,000 programs with: the
first 8 hex digits of the commit (``git rev-parse HEAD``) as an integer, so every
commit checks other programs and a failure names the seed that reproduces it;
``RAGGEDFN_PROGRAM_SEED`` overrides it, and without git it is a fixed seed.

``run_sharded`` checks the same programs as ``map_search.run_many`` (program ``i``
of a seed depends on nothing else) in several processes, each with one torch
thread: the cost is ``map``'s trace of each new program (a fresh function, so
nothing can be reused across programs), which is Python work on one core.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

import raggedfn
from property_tests.map_oracle import MapFn
from property_tests.map_search import Summary, run_many, shrink_some

SEED_ENV = "RAGGEDFN_PROGRAM_SEED"
WORKERS_ENV = "RAGGEDFN_PROGRAM_WORKERS"
FALLBACK_SEED = 0
MAX_WORKERS = 4
_ROOT = Path(__file__).resolve().parent.parent


def program_seed() -> tuple[int, str]:
    """``(seed, where it came from)``: ``$RAGGEDFN_PROGRAM_SEED``, else the commit's
    first 8 hex digits, else :data:`FALLBACK_SEED` (no git, or not a checkout)."""
    text = os.environ.get(SEED_ENV, "").strip()
    if text:
        return int(text, 0), f"${SEED_ENV}"
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        return int(head[:8], 16), f"commit {head[:8]}"
    except (OSError, subprocess.SubprocessError, ValueError):
        return FALLBACK_SEED, "the fixed seed (no git commit found)"


def default_workers() -> int:
    """``$RAGGEDFN_PROGRAM_WORKERS``, else the usable cores (at most :data:`MAX_WORKERS`)."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text:
        return max(1, int(text))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    # under pytest-xdist the other test workers share the cores: this one takes its share
    share = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    return max(1, min(cores // share, MAX_WORKERS))


def rerun_commands(seed: int, count: int, min_steps: int, max_steps: int) -> str:
    """The command lines that check the same programs again."""
    return (
        f"rerun: {SEED_ENV}={seed} python -m pytest -q property_tests/test_map_programs.py\n"
        f"   or: python -m property_tests.map_oracle --programs {count} --seed {seed} "
        f"--min-steps {min_steps} --max-steps {max_steps} (make test-deep SEED={seed}: "
        "20,000 programs of 2-6 steps)"
    )


def _start_worker(filters: list[Any]) -> None:
    """A worker warns as the caller does (pytest's filterwarnings=error included) and
    uses one torch thread (the samples are tiny; the cores go to the workers)."""
    warnings.filters[:] = filters
    torch.set_num_threads(1)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _part(
    seed: int,
    start: int,
    count: int,
    min_steps: int,
    max_steps: int,
    map_fn: MapFn,
    progress: bool,
) -> Summary:
    return run_many(
        seed,
        count,
        min_steps,
        max_steps,
        map_fn,
        shrink_per_group=0,
        shrink_first=0,
        progress=_progress if progress else None,
        start=start,
    )


def merge(seed: int, parts: list[Summary]) -> Summary:
    """One summary of parts that checked consecutive index ranges, in order."""
    out = Summary(seed, workers=0)
    for part in parts:
        out.programs += part.programs
        out.counts += part.counts
        out.warned += part.warned
        out.found.extend(part.found)
        out.cpu_seconds += part.cpu_seconds
        for kind, index in part.first.items():
            out.first[kind] = min(index, out.first.get(kind, index))
    out.counts = Counter({k: n for k, n in out.counts.items() if n})
    out.found.sort(key=lambda f: f.index)
    return out


def run_sharded(
    seed: int,
    count: int,
    workers: int,
    *,
    min_steps: int = 2,
    max_steps: int = 6,
    shrink_per_group: int = 1,
    shrink_first: int = 0,
    shrink_budget: int = 40,
    map_fn: MapFn = raggedfn.map,
    progress: bool = False,
) -> Summary:
    """``run_many(seed, count, ...)`` with the programs checked by ``workers`` processes
    (in parts of consecutive indices, a few per worker so that they finish together);
    the failures are shrunk here afterwards. ``workers=1`` runs in this process."""
    if workers <= 1 or count < 2:
        return run_many(
            seed,
            count,
            min_steps,
            max_steps,
            map_fn,
            shrink_per_group=shrink_per_group,
            shrink_first=shrink_first,
            shrink_budget=shrink_budget,
            progress=_progress if progress else None,
        )
    size = max(1, -(-count // (4 * workers)))
    began = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # never fork a process running torch
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(list(warnings.filters),)
    ) as pool:
        futures = [
            pool.submit(
                _part, seed, start, min(size, count - start), min_steps, max_steps, map_fn, progress
            )
            for start in range(0, count, size)
        ]
        try:
            summary = merge(seed, [future.result() for future in futures])
        except BaseException:
            for future in futures:  # a part raised: do not wait for the rest
                future.cancel()
            raise
    summary.seconds = time.perf_counter() - began
    summary.workers = workers
    shrink_some(summary, shrink_per_group, shrink_first, shrink_budget, map_fn)
    return summary


__all__ = ["default_workers", "merge", "program_seed", "rerun_commands", "run_sharded"]
