"""Peak memory of a step, measured in a fresh interpreter.

How much the peak RSS grows (``VmHWM``, the peak mark reset through
``/proc/self/clear_refs``) while the step runs once more after a first run, with
its inputs built and the previous system's freed; ``MALLOC_MMAP_THRESHOLD_`` is
set in the child so freed blocks leave the RSS. On CUDA it is
``torch.cuda.max_memory_allocated`` above what was held before the step. One child
(``python -m benchmarks._memory --measure-memory -``) measures a whole suite's
cases and systems in turn, after the timing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ._cases import Case, Suite, load_suite


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
    step.run()  # first-call allocations (thread pools, caches, workspaces) are not the step's
    if case.device.startswith("cuda"):
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step.run()
        torch.cuda.synchronize()
        return max(0.0, (torch.cuda.max_memory_allocated() - held) / 2**20)
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
        sys.executable, "-m", "benchmarks._memory", "--measure-memory", "-",
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


# ----- the child's entry point --------------------------------------------------------


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
