"""How far ``make bench``'s BERT rows can get: raggedfn against a dense batch of its own tokens.

The BERT suite's ideal ratio (``benchmarks/bert.py``: real over padded FLOPs) assumes
a step costs its FLOPs. At ``make bench``'s shortened lengths it does not: a step also
reads every weight and writes every weight gradient once, whatever the token count,
and a matrix product with few rows runs below the speed of a larger one. This script
measures the floor a packed system can reach: the padded model on an **equal-length
batch with the same total tokens** (``dense@T``: about ``T / B`` tokens per sample, no
padding, the same attention kernels), next to ``padded``, ``raggedfn`` and ``map`` at
the suite's own cases (lognormal, fwd+bwd); raggedfn's and ``map``'s outputs and
gradients are checked against ``padded`` first.

Each round runs every system once, in rotated order; the table gives medians of
per-round ratios to ``padded`` and each ratio's share of the ideal (ideal / ratio, as
the suite's ``of ideal`` column), and ``raggedfn / dense@T`` (1.0: raggedfn adds
nothing to the work of its real tokens).

Run: ``python -m benchmarks.bert_floor [--workload tiny ...] [--rounds 15] [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import warnings

import torch

from benchmarks import bert
from benchmarks._systems import SYSTEMS
from benchmarks._timing import disagreement


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=list(bert.SCALES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="make bench-quick's sizes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workloads = args.workload or ["tiny", "mini", "small"]
    rows: list[str] = []
    print(
        "| scale | B | tokens | ideal | padded ms | raggedfn of ideal | map of ideal "
        "| dense@T of ideal | raggedfn / dense@T |\n|---|---|---|---|---|---|---|---|---|"
    )
    for case in bert.SUITE.cases(quick=args.quick):
        if (case.workload, case.mode, case.distribution) not in {
            (w, "fwd+bwd", "lognormal") for w in workloads
        }:
            continue
        total, batch = sum(case.lengths), len(case.lengths)
        length = max(1, round(total / batch))
        equal = dataclasses.replace(
            case, lengths=(length,) * max(1, round(total / length)), distribution="equal"
        )
        model = bert.model(case.workload)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps = {name: SYSTEMS[name](case, model) for name in ("padded", "raggedfn", "map")}
            steps["dense@T"] = SYSTEMS["padded"](equal, model)
            want = steps["padded"].collect(steps["padded"].run())
            for name in ("raggedfn", "map"):  # never time a wrong computation
                wrong = disagreement(steps[name].collect(steps[name].run()), want, case.dtype)
                if wrong:
                    raise AssertionError(f"{case.workload} {name}: {wrong}")
            for step in steps.values():
                step.run()
                step.run()
            times: dict[str, list[float]] = {name: [] for name in steps}
            names = list(steps)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    start = time.perf_counter()
                    steps[name].run()
                    times[name].append(time.perf_counter() - start)
        ideal = bert.SUITE.ideal_ratio(case)

        def ratio(a: str, b: str, times: dict[str, list[float]] = times) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

        rows.append(
            f"| {case.workload} | {batch} | {total} | {ideal:.3f} "
            f"| {statistics.median(times['padded']) * 1e3:.1f} "
            f"| {ideal / ratio('raggedfn', 'padded'):.2f} | {ideal / ratio('map', 'padded'):.2f} "
            f"| {ideal / ratio('dense@T', 'padded'):.2f} | {ratio('raggedfn', 'dense@T'):.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
