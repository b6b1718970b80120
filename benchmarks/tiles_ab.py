"""Row tiles on vs off for the ``map`` system of the ``make bench`` suites (issue 18).

Every case of a suite (``bert``, ``token_mlp``; full sizes, or ``--quick``) runs the
``map`` system twice, with row tiles and blocks as they are (``on``) and with them
unable to start (``off``: ``TILE_ELEMENTS`` beyond any batch), next to the suite's
``padded``, ``loop``, ``nested`` and ``danling`` where they run. Method: one process,
1 thread, every system's output checked against the padded one first, then rounds in
which every system runs once in a rotated order; times are CPU time of the thread
(``time.thread_time``: on a loaded machine wall time also counts the time the thread
waits for a core), a cell is the median over rounds and ``x/padded`` the median of
per-round ratios.

Usage: ``python -m benchmarks.tiles_ab --suite bert --rounds 5``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks._cases import Missing, load_suite
from raggedfn._map.running import _blocks, _tiles

OTHERS = ("loop", "nested", "danling")


def _off(run):  # type: ignore[no-untyped-def]
    def off():  # type: ignore[no-untyped-def]
        tile, block = _tiles.TILE_ELEMENTS, _blocks.TILE_ELEMENTS
        _tiles.TILE_ELEMENTS = _blocks.TILE_ELEMENTS = 1 << 62
        try:
            return run()
        finally:
            _tiles.TILE_ELEMENTS, _blocks.TILE_ELEMENTS = tile, block

    return off


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="bert")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workload", nargs="*", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    suite = load_suite(args.suite)
    names = ["padded", "map on", "map off", *OTHERS]
    print("| workload | mode | dist | ideal | " + " | ".join(f"{n}/padded" for n in names[1:]))
    for case in suite.cases(quick=args.quick):
        if args.workload and case.workload not in args.workload:
            continue
        if hasattr(suite, "runs") and not suite.runs(case):  # type: ignore[attr-defined]
            continue
        runs = {}
        for name in names:
            system = name.split()[0]
            try:
                step = suite.build(case, system)
            except Missing:
                continue
            except Exception as error:
                print(f"  {name}: {type(error).__name__}")
                continue
            runs[name] = _off(step.run) if name == "map off" else step.run
        for run in runs.values():
            run()
            run()
        times: dict[str, list[float]] = {n: [] for n in runs}
        order = list(runs)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                start = time.thread_time()
                runs[name]()
                times[name].append(time.thread_time() - start)
        base = times["padded"]
        cells = []
        for name in names[1:]:
            if name not in times:
                cells.append("-")
                continue
            ratio = statistics.median(a / b for a, b in zip(times[name], base, strict=True))
            cells.append(f"{ratio:.3f} ({1e3 * statistics.median(times[name]):.1f} ms)")
        ideal = suite.ideal_ratio(case)
        print(
            f"| {case.workload} | {case.mode} | {case.distribution} | {ideal:.3f} | "
            + " | ".join(cells),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
