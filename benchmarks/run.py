"""Run the registered benchmark suites: ``python -m benchmarks.run [--quick] [--only NAME]``.

Each suite writes ``benchmarks/results/<suite>[-quick][-<device>].json`` (the full
record: machine, torch version, threads, seeds, every cell), a markdown table
next to it and, when matplotlib is installed, a PNG plot.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    load_suite,
    markdown_report,
    run_suite,
    write_json,
    write_markdown,
    write_plot,
)

# suite name -> module benchmarks.<name> defining SUITE; later suites register here
SUITES = ["segment_ops", "token_mlp", "bert", "pairformer_stack"]
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help=f"suite to run (of {SUITES}); repeatable"
    )
    parser.add_argument("--workload", action="append", help="only these workloads of the suite")
    parser.add_argument(
        "--system", action="append", help="only these systems (the baseline always runs)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch.set_num_threads (default 1: 2 threads are noisy on a shared 2-core machine)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the per-system memory subprocesses"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
    names = args.only or SUITES
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; known: {SUITES}")
    started = time.perf_counter()
    written: list[tuple[Path, dict[str, Any]]] = []
    for name in names:
        suite = load_suite(name)
        systems = None
        if args.system:
            systems = [suite.baseline, *(s for s in args.system if s != suite.baseline)]
        record = run_suite(
            suite,
            quick=args.quick,
            device=args.device,
            threads=args.threads,
            warmup=args.warmup,
            repeats=args.repeats,
            memory=not args.no_memory,
            only_workloads=args.workload,
            systems=systems,
        )
        stem = (
            name
            + ("-quick" if args.quick else "")
            + ("" if args.device == "cpu" else f"-{args.device}")
        )
        write_json(record, args.out / f"{stem}.json")
        written.append((args.out / f"{stem}.json", record))
        write_markdown(record, args.out / f"{stem}.md")
        plotted = write_plot(record, args.out / f"{stem}.png")
        print(markdown_report(record))
        print(
            f"wrote {args.out / stem}.json/.md" + (" and .png" if plotted else ""), file=sys.stderr
        )
    # the whole run (every suite and writer; not the ~2 s of importing torch) in every record
    run_info = {
        "suites": {record["suite"]: record["seconds"] for _, record in written},
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    for path, record in written:
        record["run"] = run_info
        write_json(record, path)
    print(total_line(run_info))
    return 0


def total_line(run_info: dict[str, Any]) -> str:
    """``total elapsed 2 min 41 s (segment_ops 38 s, ...)``."""
    parts = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in run_info["suites"].items())
    minutes, seconds = divmod(round(run_info["total_seconds"]), 60)
    return f"total elapsed {minutes} min {seconds} s ({parts})"


if __name__ == "__main__":
    raise SystemExit(main())
