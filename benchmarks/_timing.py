"""Timing one case: build and check every system, then time them all in rounds.

Method (the same for every cell):

- one process, a fixed number of threads (set by the caller);
- every system's step is built and its first output compared per sample with the
  padded baseline's; a system that disagrees is ``wrong: ...`` and never timed;
- warm-up calls (none after the checked first call of a step slower than
  :data:`SLOW_STEP_S`), and a calibration so that one timed sample lasts at
  least ``min_time`` (fast steps repeat inside a sample);
- then rounds: in each round **every** system that runs (the baseline included)
  is timed once, in an order rotated from round to round, so a drift of the
  shared machine hits all of them alike; ``repeats`` rounds, or as many as fit in
  ``max_seconds`` per system, at least 3;
- a cell's time is the median over rounds; its ``ratio`` is the median of the
  per-round ratios ``system / padded``, and ``versus[other]`` the median of the
  per-round ratios ``system / other`` for every other system that ran (so
  "raggedfn vs the loop" is measured, not divided out of two medians).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._cases import Case, Missing, Step, Suite

# a step whose first (checked) call took this long is warm after it: no more warm-up calls
SLOW_STEP_S = 1.0


def sync(device: str) -> None:
    """Wait for queued device work (CUDA kernels run asynchronously)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_once(run: Callable[[], Any], device: str, number: int) -> float:
    """Seconds per call of ``number`` back-to-back calls."""
    sync(device)
    start = time.perf_counter()
    for _ in range(number):
        run()
    sync(device)
    return (time.perf_counter() - start) / number


def calibrate(run: Callable[[], Any], device: str, min_time: float) -> int:
    """Calls per sample so one sample lasts at least ``min_time`` seconds."""
    # the median of three single runs: on a loaded machine one run can be 30x slower
    once = statistics.median(time_once(run, device, 1) for _ in range(3))
    return max(1, min(1000, math.ceil(min_time / max(once, 1e-7))))


def checked_run(step: Step, device: str) -> tuple[Any, float]:
    """The step's first call (its output is checked) and how long it took."""
    sync(device)
    start = time.perf_counter()
    out = step.run()
    sync(device)
    return out, time.perf_counter() - start


def warm_up(run: Callable[[], Any], device: str, warmup: int, min_time: float, first: float) -> int:
    """Run the warm-up calls (timed), then return the calls per sample.

    ``first`` is the duration of the step's first, checked call. A step slower than
    :data:`SLOW_STEP_S` counts that call as its warm-up (one more 4-10 s call of a
    Pairformer or BERT-base cell would only cost time). A step whose calls already
    last ``min_time`` needs one call per sample and no calibration runs; faster
    steps are calibrated with :func:`calibrate` (milliseconds).
    """
    if first >= SLOW_STEP_S:
        return 1
    times = [time_once(run, device, 1) for _ in range(warmup)]
    if times and min(times) >= min_time:
        return 1
    return calibrate(run, device, min_time)


@dataclass
class Cell:
    """One measured (case, system): medians in milliseconds, or a status saying why not."""

    suite: str
    workload: str
    mode: str
    distribution: str
    system: str
    status: str  # "ok", "missing: <why>", "fails: <error>", "wrong: <what differs>"
    time_ms: float | None = None
    baseline_ms: float | None = None
    ratio: float | None = None  # system / padded, median of per-round ratios
    ideal_ratio: float | None = None
    fraction_of_ideal: float | None = None
    peak_memory_mb: float | None = None
    rounds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # wall time this system took in the case (build, check, warm-up, its timed calls)
    seconds: float | None = None
    # other system -> median of per-round ratios (this system's time / the other's)
    versus: dict[str, float] = field(default_factory=dict)


def status_of(error: BaseException) -> str:
    if isinstance(error, Missing):
        return f"missing: {error}"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"fails: {type(error).__name__}: {text[:160]}"


def disagreement(got: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype) -> str:
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


@dataclass
class _Ready:
    """A built, checked and warmed-up system: its step and calls per timed sample."""

    step: Step
    number: int
    times: list[float] = field(default_factory=list)


def _prepare(
    suite: Suite,
    case: Case,
    system: str,
    cell: Cell,
    expected: list[torch.Tensor],
    warmup: int,
    min_time: float,
) -> _Ready | None:
    """Build, check and warm up ``system``; ``None`` (with the cell's status set) if it cannot run."""
    started = time.perf_counter()
    try:
        step = suite.build(case, system)
        cell.extra.update(step.extra)
        out, first = checked_run(step, case.device)
        wrong = disagreement(step.collect(out), expected, case.dtype)
        if wrong:  # never time a wrong computation
            cell.status = f"wrong: {wrong}"
            return None
        del out
        return _Ready(step, warm_up(step.run, case.device, warmup, min_time, first))
    except Exception as error:  # report the cell, keep the suite going
        cell.status = status_of(error)
        return None
    finally:
        cell.seconds = round(time.perf_counter() - started, 2)


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
    """Time every system of ``case`` (and the suite's baseline) in interleaved rounds.

    Returns one :class:`Cell` per entry of ``systems``, in that order. The
    baseline (``suite.baseline``, the padded computation unless a suite says
    otherwise) is always built and timed in every round; its output is the
    reference every system is checked against, unless the suite gives its own
    ``expected`` outputs. Rounds stop after ``repeats``, or once ``max_seconds`` per running
    system have passed (at least 3 rounds), so one pathological cell cannot stall
    the suite.
    """
    ideal = suite.ideal_ratio(case)
    cells = {
        system: Cell(suite.name, case.workload, case.mode, case.distribution, system, "ok")
        for system in systems
    }
    for cell in cells.values():
        cell.ideal_ratio = ideal
    started = time.perf_counter()
    base_name = suite.baseline
    baseline = suite.build(case, base_name)
    out, first = checked_run(baseline, case.device)
    if suite.expected is None:
        expected = baseline.collect(out)
    else:
        expected = suite.expected(case)
        wrong = disagreement(baseline.collect(out), expected, case.dtype)
        if baseline.checked and wrong:
            raise AssertionError(f"{suite.name}: the baseline {base_name} is wrong: {wrong}")
    del out
    number = warm_up(baseline.run, case.device, warmup, min_time, first)
    ready = {base_name: _Ready(baseline, number)}
    base_seconds = time.perf_counter() - started
    for system in systems:
        if system != base_name:
            got = _prepare(suite, case, system, cells[system], expected, warmup, min_time)
            if got is not None:
                ready[system] = got
    names = list(ready)
    deadline = time.perf_counter() + max_seconds * len(names)
    for r in range(repeats):
        if r >= 3 and time.perf_counter() > deadline:
            break
        # rotate the order, so that no system always runs first (cold), and reverse it every
        # other round, so that none always runs right after the same other one (a rotation
        # alone keeps each system's predecessor: what that one leaves behind, freed memory
        # the allocator gave back or caches full of its data, would bias one system's time)
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order[::-1] if r % 2 else order:
            one = ready[name]
            one.times.append(time_once(one.step.run, case.device, one.number))
    base_times = ready[base_name].times
    for name, one in ready.items():
        if name not in cells:
            continue
        cell = cells[name]
        cell.extra.update(one.step.extra)
        cell.rounds = len(one.times)
        cell.time_ms = 1e3 * statistics.median(one.times)
        cell.baseline_ms = 1e3 * statistics.median(base_times)
        cell.ratio = 1.0 if name == base_name else _median_ratio(one.times, base_times)
        cell.fraction_of_ideal = ideal / cell.ratio
        cell.versus = {
            other: round(_median_ratio(one.times, ready[other].times), 4)
            for other in names
            if other not in (name, base_name)
        }
        spent = sum(one.times) * one.number
        own = base_seconds if name == base_name else (cell.seconds or 0.0)
        cell.seconds = round(own + spent, 2)
    return list(cells.values())


def _median_ratio(times: Sequence[float], others: Sequence[float]) -> float:
    return statistics.median(a / b for a, b in zip(times, others, strict=True))
