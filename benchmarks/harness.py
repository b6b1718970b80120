"""The benchmark harness every suite uses (``python -m benchmarks.run``).

The pieces, one concern each:

- :mod:`benchmarks._cases`: length distributions, :class:`Case`, :class:`Step`,
  :class:`Suite` (what a suite defines);
- :mod:`benchmarks._timing`: build, check and time one case, every system in
  interleaved rounds (the method, in its docstring);
- :mod:`benchmarks._memory`: peak memory per system, in one fresh subprocess per
  suite run;
- :mod:`benchmarks._report`: the JSON record, markdown tables and plots;
- this module: :func:`run_suite` (a whole suite into one record) and the machine
  description, and the names above re-exported for suites and scripts.

Devices: every suite builds its inputs on ``case.device``; the timing waits for
the device (``torch.cuda.synchronize``) around each timed sample, and on CUDA peak
memory is ``torch.cuda.max_memory_allocated``. ``python -m benchmarks.gpu`` runs
every benchmark on a GPU when one is available.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ._cases import (
    BASELINE,
    DISTRIBUTIONS,
    Case,
    Distribution,
    Missing,
    Step,
    Suite,
    load_suite,
    occupancy,
)
from ._memory import (
    measure_memory,
    measure_memory_cases,
    measure_memory_here,
    measure_memory_systems,
)
from ._report import (
    markdown_report,
    markdown_table,
    summary_lines,
    versus_table,
    write_json,
    write_markdown,
    write_plot,
)
from ._timing import (
    SLOW_STEP_S,
    Cell,
    disagreement,
    measure_case,
    warm_up,
)

__all__ = [
    "BASELINE",
    "DISTRIBUTIONS",
    "SLOW_STEP_S",
    "Case",
    "Cell",
    "Distribution",
    "Missing",
    "Step",
    "Suite",
    "disagreement",
    "load_suite",
    "machine",
    "markdown_report",
    "markdown_table",
    "measure_case",
    "measure_memory",
    "measure_memory_cases",
    "measure_memory_here",
    "measure_memory_systems",
    "occupancy",
    "run_suite",
    "summary_lines",
    "versus_table",
    "warm_up",
    "write_json",
    "write_markdown",
    "write_plot",
]


def machine() -> dict[str, Any]:
    """What the numbers were taken on."""
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": model,
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        info["load_average"] = [round(v, 2) for v in os.getloadavg()]
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _progress(items: list[Any], desc: str) -> Iterable[Any]:
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="cell", leave=False, dynamic_ncols=True)


def run_suite(
    suite: Suite,
    *,
    quick: bool = False,
    device: str = "cpu",
    threads: int = 1,
    warmup: int | None = None,
    repeats: int | None = None,
    memory: bool = True,
    only_workloads: Sequence[str] | None = None,
    systems: Sequence[str] | None = None,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """Measure every cell of ``suite`` and return the JSON-able record."""
    # the full run's budget (`make bench` < 15 min at 1 thread, docs/benchmarks.md): the
    # per-round ratio of alternated runs is stable to a few % after 3-7 rounds here
    max_seconds = (1.0 if quick else 2.0) if max_seconds is None else max_seconds
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    warmup = 1 if warmup is None else warmup
    repeats = (5 if quick else 7) if repeats is None else repeats
    systems = list(systems or suite.systems)
    cases = [
        c
        for c in suite.cases(quick=quick, device=device)
        if not only_workloads or c.workload in only_workloads
    ]
    started = time.time()
    cells: list[Cell] = []
    to_measure: list[tuple[Case, list[Cell]]] = []
    bar = _progress(cases, suite.name)
    for case in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{case.workload} {case.mode} {case.distribution}")
        got = measure_case(
            suite, case, systems, warmup=warmup, repeats=repeats, max_seconds=max_seconds
        )
        if memory and (suite.memory_for is None or suite.memory_for(case)):
            to_measure.append((case, [cell for cell in got if cell.status == "ok"]))
        cells.extend(got)
    if to_measure:  # one child interpreter for the whole suite, after the timing
        print(f"{suite.name}: peak memory of {len(to_measure)} cases...", file=sys.stderr)
        peaks = measure_memory_cases(
            [(case, [cell.system for cell in ok]) for case, ok in to_measure], threads
        )
        for (_, ok), peak in zip(to_measure, peaks, strict=True):
            for cell in ok:
                cell.peak_memory_mb = peak[cell.system]
    record = {
        "suite": suite.name,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python -m benchmarks.run", *sys.argv[1:]]),
        "quick": quick,
        "device": device,
        "threads": threads,
        "warmup": warmup,
        "repeats": repeats,
        "max_seconds": max_seconds,
        "torch": torch.__version__,
        "machine": machine(),
        "params": suite.params(quick),
        "distributions": {
            name: {
                **asdict(DISTRIBUTIONS[name]),
                "lengths": list(next(c.lengths for c in cases if c.distribution == name)),
                "occupancy": round(
                    occupancy(next(c.lengths for c in cases if c.distribution == name)), 4
                ),
            }
            for name in dict.fromkeys(c.distribution for c in cases)
        },
        "systems": systems,
        "primary": suite.primary,
        "baseline": suite.baseline,
        "interleaved": True,
        "seconds": round(time.time() - started, 1),
        "cells": [asdict(c) for c in cells],
    }
    return record


if __name__ == "__main__":  # the memory child's old entry point
    from ._memory import _main

    raise SystemExit(_main())
