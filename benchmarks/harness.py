"""The benchmark harness every suite uses: timing, memory, records and tables.

A *suite* (e.g. ``benchmarks.segment_ops``) defines workloads and, for each
workload, one builder per *system* (raggedfn, the padded baseline, torch.nested,
a per-sample loop, ...). A builder prepares inputs outside the timed region and
returns a :class:`Step`: a zero-argument ``run`` that does the timed work and a
``collect`` that turns its output into per-sample tensors, so the harness (and
``tests/test_harness.py``) can check that every system computes the same thing.

Method, the same for every cell:

- one process, ``torch.set_num_threads(threads)`` fixed (default 1: two threads on
  the shared 2-core machine are noisy);
- warm-up runs (none after the checked first call of a step slower than 1 s), then
  ``repeats`` rounds, or as many as fit in ``max_seconds`` per system (at least 3);
  in each round the padded baseline and the system run back to back, so a drift of the (shared, noisy) machine hits both;
  the reported ratio is the median of the per-round ratios, the times are medians;
- before timing, each system's output (forward values, or gradients for
  ``fwd+bwd``) is compared per sample with the padded baseline's; a system that
  disagrees is reported as ``wrong: ...`` and not timed;
- the ideal ratio is ``real elements / padded elements`` (weighted as the workload
  says); ``fraction of ideal = ideal ratio / measured ratio`` (1.0 = all the padding
  saved, below 1 = overhead left);
- peak memory per system is measured outside the timing process, in one fresh
  subprocess per suite run (``python -m benchmarks.harness --measure-memory -``)
  that takes the cases and their systems in turn: the growth of the peak RSS (``VmHWM``, reset through
  ``/proc/self/clear_refs``) while the step runs once more after a first run, with
  its inputs built and the previous system's freed; on CUDA
  ``torch.cuda.max_memory_allocated`` above the memory held before the step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

BASELINE = "padded"

# ----- length distributions ---------------------------------------------------------------


@dataclass(frozen=True)
class Distribution:
    """Per-sample lengths drawn with a fixed seed (printed with every result).

    ``sigma`` is the log-space spread of a lognormal with mean ``mean``; ``sigma = 0``
    gives all-equal lengths. Lengths are rounded and clipped to ``[low, high]``.
    """

    name: str
    mean: float
    sigma: float
    low: int
    high: int
    seed: int
    note: str

    def lengths(self, batch: int, scale: float = 1.0) -> list[int]:
        """``batch`` lengths; ``scale`` shrinks them for quick runs and tests."""
        if self.sigma == 0:
            drawn = np.full(batch, self.mean)
        else:
            rng = np.random.default_rng(self.seed)
            mu = math.log(self.mean) - self.sigma**2 / 2
            drawn = rng.lognormal(mu, self.sigma, batch)
        clipped = np.clip(np.round(drawn), self.low, self.high)
        return [max(1, round(float(n) * scale)) for n in clipped]


# seeds picked once so that B = 32 hits the target occupancy (mean / max length)
DISTRIBUTIONS: dict[str, Distribution] = {
    d.name: d
    for d in (
        Distribution("lognormal", 128, 1.0, 16, 512, 30, "high variation, ~25% occupancy"),
        Distribution("medium", 128, 0.45, 16, 512, 12, "medium variation, ~50% occupancy"),
        Distribution("low", 128, 0.12, 16, 512, 37, "low variation, ~80% occupancy"),
        Distribution("equal", 128, 0.0, 16, 512, 0, "all equal, padding is free"),
    )
}


def occupancy(lengths: Sequence[int], power: int = 1) -> float:
    """``sum N^p / (B * max N^p)``: the ideal time ratio of a ``N^p`` workload."""
    if not lengths:
        return 1.0
    return sum(n**power for n in lengths) / (len(lengths) * max(lengths) ** power)


# ----- suites, cases and steps -------------------------------------------------------------


class Missing(Exception):
    """A system cannot run a workload because a public name does not exist yet."""


@dataclass
class Step:
    """What a builder returns: the timed ``run`` and how to read its output per sample."""

    run: Callable[[], Any]
    collect: Callable[[Any], list[torch.Tensor]]
    # per-build facts copied into the cell (e.g. compile_s, graphs of compiled systems)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One cell's inputs: workload, mode (``fwd`` / ``fwd+bwd``) and lengths."""

    suite: str
    workload: str
    mode: str
    distribution: str
    lengths: tuple[int, ...]
    params: dict[str, Any] = field(default_factory=dict, hash=False)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int = 0


@dataclass
class Suite:
    """A named set of workloads, systems (builders) and cases."""

    name: str
    workloads: list[str]
    modes: list[str]
    systems: dict[str, Callable[[Case], Step]]
    params: Callable[[bool], dict[str, Any]]
    distributions: Callable[[bool], list[str]]
    ideal_ratio: Callable[[Case], float]
    primary: str = "raggedfn"
    # which cells get a memory subprocess (default: all); heavy suites can skip some
    memory_for: Callable[[Case], bool] | None = None

    def cases(
        self,
        quick: bool = False,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> list[Case]:
        params = self.params(quick)
        batch = params["batch"]
        scale = params.get("scale", 1.0) if scale is None else scale
        out = []
        for dist in self.distributions(quick):
            lengths = tuple(DISTRIBUTIONS[dist].lengths(batch, scale))
            for workload in self.workloads:
                for mode in self.modes:
                    out.append(
                        Case(self.name, workload, mode, dist, lengths, params, device, dtype)
                    )
        return out

    def build(self, case: Case, system: str) -> Step:
        return self.systems[system](case)


def load_suite(name: str) -> Suite:
    """The ``SUITE`` object of ``benchmarks.<name>``."""
    return importlib.import_module(f"benchmarks.{name}").SUITE


# ----- timing -----------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_once(run: Callable[[], Any], device: str, number: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(number):
        run()
    _sync(device)
    return (time.perf_counter() - start) / number


def _calibrate(run: Callable[[], Any], device: str, min_time: float) -> int:
    """Calls per sample so one sample lasts at least ``min_time`` seconds."""
    # the median of three single runs: on a loaded machine one run can be 30x slower
    once = statistics.median(_time_once(run, device, 1) for _ in range(3))
    return max(1, min(1000, math.ceil(min_time / max(once, 1e-7))))


# a step whose first (checked) call took this long is warm after it: no more warm-up calls
SLOW_STEP_S = 1.0


def _checked_run(step: Step, device: str) -> tuple[Any, float]:
    """The step's first call (its output is checked) and how long it took."""
    _sync(device)
    start = time.perf_counter()
    out = step.run()
    _sync(device)
    return out, time.perf_counter() - start


def _warm_up(
    run: Callable[[], Any], device: str, warmup: int, min_time: float, first: float
) -> int:
    """Run the warm-up calls (timed), then return the calls per sample.

    ``first`` is the duration of the step's first, checked call. A step slower than
    :data:`SLOW_STEP_S` counts that call as its warm-up (one more 4-10 s call of a
    Pairformer or BERT-base cell would only cost time). A step whose calls already
    last ``min_time`` needs one call per sample and no calibration runs; faster
    steps are calibrated with :func:`_calibrate` (milliseconds).
    """
    if first >= SLOW_STEP_S:
        return 1
    times = [_time_once(run, device, 1) for _ in range(warmup)]
    if times and min(times) >= min_time:
        return 1
    return _calibrate(run, device, min_time)


@dataclass
class Cell:
    """One measured (case, system): medians in milliseconds, or a status saying why not."""

    suite: str
    workload: str
    mode: str
    distribution: str
    system: str
    status: str  # "ok", "missing: <name>", "fails: <error>", "wrong: <what differs>"
    time_ms: float | None = None
    baseline_ms: float | None = None
    ratio: float | None = None  # system / padded, median of per-round ratios
    ideal_ratio: float | None = None
    fraction_of_ideal: float | None = None
    peak_memory_mb: float | None = None
    rounds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # wall time this system took in the case (build, check, warm-up, rounds), for budgeting
    seconds: float | None = None


def _status_of(error: BaseException) -> str:
    if isinstance(error, Missing):
        return f"missing: {error}"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"fails: {type(error).__name__}: {text[:160]}"


def _disagreement(got: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype) -> str:
    """Empty if the per-sample outputs agree; else what differs (for a ``wrong: ...`` cell)."""
    if len(got) != len(expected):
        return f"{len(got)} samples, expected {len(expected)}"
    # a sanity check of the computation, not a precision test: float32 sums of
    # hundreds of terms differ in the last bits between summation orders
    tol = {"rtol": 1e-3, "atol": 1e-4} if dtype != torch.float64 else {"rtol": 1e-6, "atol": 1e-8}
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        g = g.detach().to(e.device)
        if g.shape != e.shape:
            return f"sample {i} has shape {tuple(g.shape)}, expected {tuple(e.shape)}"
        if not torch.allclose(g, e, equal_nan=True, **tol):
            diff = (g - e).abs().nan_to_num(nan=float("inf")).max().item()
            return f"sample {i} differs from padded by up to {diff:.3g}"
    return ""


def measure_case(
    suite: Suite,
    case: Case,
    systems: Sequence[str],
    *,
    warmup: int = 2,
    repeats: int = 7,
    min_time: float = 0.03,
    max_seconds: float = 20.0,
) -> list[Cell]:
    """Time every system of ``case`` against the padded baseline, alternating them.

    Each system gets ``repeats`` rounds, or as many as fit in ``max_seconds``
    (at least 3), so one pathological cell cannot stall the suite.
    """
    ideal = suite.ideal_ratio(case)
    started = time.perf_counter()
    baseline = suite.build(case, BASELINE)
    out, first = _checked_run(baseline, case.device)
    expected = baseline.collect(out)
    number_base = _warm_up(baseline.run, case.device, warmup, min_time, first)
    base_seconds = time.perf_counter() - started
    cells: list[Cell] = []
    base_times: list[float] = []
    for system in systems:
        cell = Cell(suite.name, case.workload, case.mode, case.distribution, system, "ok")
        cell.ideal_ratio = ideal
        cells.append(cell)
        if system == BASELINE:
            continue
        started = time.perf_counter()
        try:
            step = suite.build(case, system)
            cell.extra.update(step.extra)
            out, first = _checked_run(step, case.device)
            wrong = _disagreement(step.collect(out), expected, case.dtype)
            if wrong:  # never time a wrong computation
                cell.status = f"wrong: {wrong}"
                continue
            number = _warm_up(step.run, case.device, warmup, min_time, first)
        except Exception as error:  # report the cell, keep the suite going
            cell.status = _status_of(error)
            continue
        finally:
            cell.seconds = round(time.perf_counter() - started, 2)
        times, ratios = [], []
        deadline = time.perf_counter() + max_seconds
        for r in range(repeats):
            if r >= 3 and time.perf_counter() > deadline:
                break
            # alternate which of the pair goes first, so neither always runs on a warm cache
            if r % 2:
                t_sys = _time_once(step.run, case.device, number)
                t_base = _time_once(baseline.run, case.device, number_base)
            else:
                t_base = _time_once(baseline.run, case.device, number_base)
                t_sys = _time_once(step.run, case.device, number)
            base_times.append(t_base)
            times.append(t_sys)
            ratios.append(t_sys / t_base)
        cell.time_ms = 1e3 * statistics.median(times)
        cell.baseline_ms = 1e3 * statistics.median(base_times[-len(times) :])
        cell.ratio = statistics.median(ratios)
        cell.fraction_of_ideal = ideal / cell.ratio
        cell.rounds = len(times)
        cell.seconds = round(time.perf_counter() - started, 2)  # includes padded's rounds
        del step
    if BASELINE in systems:
        base_cell = next(c for c in cells if c.system == BASELINE)
        base_cell.extra.update(baseline.extra)
        if not base_times:  # the baseline alone: time it on its own
            started = time.perf_counter()
            base_times = [
                _time_once(baseline.run, case.device, number_base) for _ in range(repeats)
            ]
            base_seconds += time.perf_counter() - started
        base_cell.time_ms = base_cell.baseline_ms = 1e3 * statistics.median(base_times)
        base_cell.ratio = 1.0
        base_cell.fraction_of_ideal = ideal
        base_cell.rounds = len(base_times)
        base_cell.seconds = round(base_seconds, 2)  # build, check, warm-up (rounds: above)
    return cells


# ----- memory (in a subprocess) -----------------------------------------------------------


def _status_kib(field_name: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_rss_mb() -> float:
    peak = _status_kib("VmHWM")
    if peak is None:  # not Linux: the lifetime peak (KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024


def measure_memory_here(suite: Suite, case: Case, system: str) -> float:
    """Peak memory (MiB) that running ``system``'s step adds above its inputs."""
    step = suite.build(case, system)
    if case.device.startswith("cuda"):
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step.run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - held) / 2**20
    step.run()  # first-call allocations (thread pools, caches) are not the step's memory
    current = _status_kib("VmRSS")
    before = current / 1024 if _reset_peak_rss() and current is not None else _peak_rss_mb()
    step.run()
    return max(0.0, _peak_rss_mb() - before)


def measure_memory(case: Case, system: str, threads: int, timeout: float = 300) -> float | None:
    """Run :func:`measure_memory_here` in a fresh interpreter; ``None`` if it fails."""
    return measure_memory_systems(case, [system], threads, timeout)[system]


def measure_memory_systems(
    case: Case, systems: Sequence[str], threads: int, timeout: float = 600
) -> dict[str, float | None]:
    """Peak memory of each system's step, measured in one fresh interpreter."""
    return measure_memory_cases([(case, list(systems))], threads, timeout)[0]


def measure_memory_cases(
    work: Sequence[tuple[Case, Sequence[str]]], threads: int, timeout: float = 600
) -> list[dict[str, float | None]]:
    """Peak memory of each (case, system), measured in one fresh interpreter per suite.

    The child measures the systems one after another, each from a reset peak mark
    (``/proc/self/clear_refs``; on CUDA ``reset_peak_memory_stats``) after the
    previous system's inputs were freed, which saves an interpreter start (several
    seconds of ``import torch`` on a loaded machine) per case and system: a
    suite's memory costs one interpreter start. Where the peak mark cannot be
    reset, every system gets its own interpreter. ``timeout`` is per case.
    """
    out: list[dict[str, float | None]] = [dict.fromkeys(systems) for _, systems in work]
    by_index = [i for i, (_, systems) in enumerate(work) if systems]  # child index -> ours
    work = [(case, list(systems)) for case, systems in work if systems]
    if not work:
        return out
    device = work[0][0].device
    if not device.startswith("cuda") and not _can_reset_peak():
        many = sum(len(systems) for _, systems in work) > 1
        if many:
            return [
                {s: measure_memory_cases([(case, [s])], threads, timeout)[0][s] for s in systems}
                for case, systems in work
            ]
    command = [
        sys.executable, "-m", "benchmarks.harness", "--measure-memory", "-",
        "--threads", str(threads),
    ]  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        # large blocks straight from mmap: freed memory leaves the RSS, so the peak
        # of one step is not hidden by memory glibc kept from building the inputs
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    payload = json.dumps([[_case_to_json(case), systems] for case, systems in work])
    try:
        done = subprocess.run(
            command, input=payload, capture_output=True, text=True,
            timeout=timeout * len(work), cwd=root, env=env, check=False,
        )  # fmt: skip
        stdout = done.stdout
    except subprocess.TimeoutExpired as expired:  # keep what was measured before
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else ""
    for line in stdout.splitlines():
        index, _, rest = line.partition(" ")
        name, _, value = rest.rpartition(" ")
        with contextlib.suppress(ValueError, IndexError):
            row = out[by_index[int(index)]]
            if name in row:
                row[name] = float(value)
    return out


def _can_reset_peak() -> bool:
    return Path("/proc/self/clear_refs").exists() and _status_kib("VmHWM") is not None


def _case_to_json(case: Case) -> dict[str, Any]:
    data = asdict(case)
    data["dtype"] = str(case.dtype).removeprefix("torch.")
    data["lengths"] = list(case.lengths)
    return data


def _case_from_json(data: dict[str, Any]) -> Case:
    data = dict(data)
    data["dtype"] = getattr(torch, data["dtype"])
    data["lengths"] = tuple(data["lengths"])
    return Case(**data)


# ----- running a suite --------------------------------------------------------------------


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
        "seconds": round(time.time() - started, 1),
        "cells": [asdict(c) for c in cells],
    }
    return record


# ----- writers ----------------------------------------------------------------------------


def write_json(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")


def _fmt_time(cell: dict[str, Any]) -> str:
    if cell["status"] != "ok":
        return cell["status"].split(":", 1)[0]  # missing / fails / wrong (details below)
    if cell["system"] == BASELINE:
        return f"{cell['time_ms']:.2f}"
    return f"{cell['time_ms']:.2f} ({cell['ratio']:.2f}x)"


def markdown_table(record: dict[str, Any]) -> str:
    """The results as markdown: one table per distribution, one row per workload and mode.

    Each system column shows the median time in ms and, in brackets, its ratio to
    the padded time in the same rounds (lower is better). ``ideal`` is the ratio
    that saving all padding would give; ``of ideal`` is ideal / the primary
    system's ratio. Memory columns give the peak MiB each system's step added.
    """
    systems: list[str] = record["systems"]
    primary = record["primary"]
    cells = record["cells"]
    lines: list[str] = []
    notes: dict[str, str] = {}
    for dist, info in record["distributions"].items():
        lines.append(
            f"**{dist}** ({info['note']}; B = {len(info['lengths'])}, "
            f"mean length {sum(info['lengths']) / max(len(info['lengths']), 1):.1f}, "
            f"max {max(info['lengths'], default=0)}, occupancy {info['occupancy']:.3f}, "
            f"seed {info['seed']})"
        )
        lines.append("")
        header = ["op", "mode", *(f"{s} ms" for s in systems), "ideal", f"{primary} of ideal"]
        has_memory = any(c["peak_memory_mb"] is not None for c in cells)
        if has_memory:
            header += [f"{s} MiB" for s in systems]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        rows = dict.fromkeys((c["workload"], c["mode"]) for c in cells if c["distribution"] == dist)
        for workload, mode in rows:
            by_system = {
                c["system"]: c
                for c in cells
                if c["distribution"] == dist and c["workload"] == workload and c["mode"] == mode
            }
            row = [workload, mode]
            for s in systems:
                cell = by_system.get(s)
                row.append(_fmt_time(cell) if cell else "")
                if cell and cell["status"] != "ok":
                    notes.setdefault(f"{s} {workload} {mode}", cell["status"])
            first = next(iter(by_system.values()))
            row.append(f"{first['ideal_ratio']:.3f}")
            main = by_system.get(primary)
            row.append(
                f"{main['fraction_of_ideal']:.2f}"
                if main and main["fraction_of_ideal"] is not None
                else ""
            )
            if has_memory:
                for s in systems:
                    cell = by_system.get(s)
                    mem = cell["peak_memory_mb"] if cell else None
                    row.append(f"{mem:.1f}" if mem is not None else "")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines.extend(summary_lines(record))
    if notes:
        lines.append("Cells that did not run:")
        lines.append("")
        for where, status in notes.items():
            lines.append(f"- {where}: {status}")
        lines.append("")
    return "\n".join(lines)


def summary_lines(record: dict[str, Any]) -> list[str]:
    """Geometric-mean speedup over padded across a suite's workloads, and compile facts.

    One line per (distribution, mode, system) with every workload measured
    (``ok``); compiled systems' compile time (first call minus second, s) and
    graphs compiled are listed per cell where the builder recorded them.
    """
    cells = record["cells"]
    lines: list[str] = []
    groups = dict.fromkeys(
        (c["distribution"], c["mode"], c["system"]) for c in cells if c["system"] != BASELINE
    )
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    for dist, mode, system in groups:
        got = [
            c
            for c in cells
            if (c["distribution"], c["mode"], c["system"]) == (dist, mode, system)
            and c["status"] == "ok"
        ]
        if len(workloads) < 2 or len(got) != len(workloads):
            continue
        speedup = math.exp(statistics.fmean(-math.log(c["ratio"]) for c in got))
        ideal = math.exp(statistics.fmean(-math.log(c["ideal_ratio"]) for c in got))
        lines.append(
            f"- {dist}, {mode}, {system}: geometric-mean speedup over padded "
            f"{speedup:.2f}x across {', '.join(workloads)} (ideal {ideal:.2f}x)"
        )
    if lines:
        lines = ["Summary:", "", *lines, ""]
    compiled = [c for c in cells if "compile_s" in c.get("extra", {})]
    if compiled:
        lines += ["Compile time (first call minus second, s) / graphs compiled:", ""]
        lines += [
            f"- {c['workload']} {c['mode']} {c['distribution']} {c['system']}: "
            f"{c['extra']['compile_s']} s / {c['extra'].get('graphs', '?')} graphs"
            for c in compiled
        ]
        lines.append("")
    return lines


def markdown_report(record: dict[str, Any]) -> str:
    """A heading, the run's settings and :func:`markdown_table`."""
    m = record["machine"]
    head = [
        f"### {record['suite']} ({'quick' if record['quick'] else 'full'}, {record['device']})",
        "",
        f"`{record['command']}` on {m['cpu']} ({m['nproc']} CPUs), torch {record['torch']}, "
        f"{record['threads']} threads, {record['warmup']} warm-up runs, median of "
        f"{record['repeats']} rounds (at least 3, fewer where a system used up its "
        f"{record.get('max_seconds', '?')} s budget), {record['created']}.",
        "",
    ]
    return "\n".join(head) + markdown_table(record)


def write_markdown(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_report(record))


def write_plot(record: dict[str, Any], path: Path) -> bool:
    """Speedup over padded per workload and distribution, ideal marked (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cells = [c for c in record["cells"] if c["status"] == "ok" and c["system"] != BASELINE]
    rows = list(dict.fromkeys((c["distribution"], c["mode"]) for c in cells))
    if not rows:
        return False
    systems = [s for s in record["systems"] if s != BASELINE]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.6 * len(rows)), squeeze=False)
    for ax, (dist, mode) in zip(axes[:, 0], rows, strict=True):
        workloads = list(dict.fromkeys(c["workload"] for c in cells if c["distribution"] == dist))
        width = 0.8 / max(len(systems), 1)
        for k, system in enumerate(systems):
            heights = []
            for w in workloads:
                match = [
                    c
                    for c in cells
                    if (c["distribution"], c["mode"], c["workload"], c["system"])
                    == (dist, mode, w, system)
                ]
                heights.append(1 / match[0]["ratio"] if match else 0)
            ax.bar([i + k * width for i in range(len(workloads))], heights, width, label=system)
        ideal = [
            1
            / next(c for c in cells if c["distribution"] == dist and c["workload"] == w)[
                "ideal_ratio"
            ]
            for w in workloads
        ]
        ax.scatter(
            [i + 0.4 - width / 2 for i in range(len(workloads))],
            ideal,
            marker="_",
            s=400,
            color="black",
            label="ideal",
            zorder=3,
        )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        ax.set_ylabel("speedup vs padded")
        ax.set_yscale("log")
        ax.set_title(f"{record['suite']}: {dist}, {mode}")
        ax.legend(fontsize=7, ncol=len(systems) + 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ----- subprocess entry point -------------------------------------------------------------


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="benchmark harness child (memory probe)")
    parser.add_argument(
        "--measure-memory", metavar="WORK_JSON", required=True,
        help="JSON list of [case, [systems]] ('-': read it from stdin); prints "
        "'<case index> <system> <MiB>' per line",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = sys.stdin.read() if args.measure_memory == "-" else args.measure_memory
    for index, (case_json, systems) in enumerate(json.loads(text)):
        case = _case_from_json(case_json)
        suite = load_suite(case.suite)
        for system in systems:
            try:
                peak = measure_memory_here(suite, case, system)
            except Exception as error:  # the parent records None for this system
                print(f"{index} {system} failed: {type(error).__name__}", file=sys.stderr)
                continue
            finally:
                gc.collect()  # the step and its inputs are gone before the next one builds
            print(f"{index} {system} {peak:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
