"""Plumbing shared by the standalone benchmark scripts (``moe``, ``doc_encoder``): the
record header, rotated timing rounds with per-round ratios, and the command line
(which writes the record, its table and its plot)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def header(module: str, args: argparse.Namespace) -> dict[str, Any]:
    """The fields every record starts with: when, how it was run, where."""
    return {
        "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"python -m benchmarks.{module} " + " ".join(args.argv),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": args.threads,
    }


def rotated_rounds(
    runs: dict[str, Callable[[], float]],
    rounds: int,
    ours: str = "raggedfn",
    also: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Time every system once per round, in an order rotated from round to round and
    reversed every other round, so that no system always runs first or right after the
    same other one (round 0 warms up). ``runs[name]()`` returns the seconds of one call.

    Returns:
        ``{"median_ms": {name: ms}, "raggedfn_over": {other: median per-round ratio}}``,
        and ``"<name>_over"`` alike for each name in ``also``.
    """
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            seconds = runs[name]()
            if r:
                times[name].append(seconds)

    def over(mine: list[float], name: str) -> dict[str, float]:
        return {
            n: statistics.median(a / b for a, b in zip(mine, t, strict=True))
            for n, t in times.items()
            if n != name
        }

    return {
        "median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "raggedfn_over": over(times[ours], ours),
        **{f"{name}_over": over(times[name], name) for name in also},
    }


def timed(fn: Callable[[], Any]) -> Callable[[], float]:
    """``fn`` as a run for :func:`rotated_rounds`: the seconds of one call."""

    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def cli(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    argv: list[str] | None,
    plot: Callable[[dict[str, Any], Path], bool] | None = None,
) -> dict[str, Any]:
    """Add ``--threads/--json/--markdown`` to ``parser``, run, print the table, write files
    (with ``plot``, a PNG next to the ``--json`` record)."""
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the record here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else []
    record = run(args)
    text = markdown(record)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        if plot is not None:
            plot(record, Path(args.json).with_suffix(".png"))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return record
