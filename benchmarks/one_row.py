"""Batches holding samples of one row through ``raggedfn.map``: a 2-layer HF BERT.

A sample of length 1 makes transformers take other branches (a ``[1, 1]`` attention
mask broadcasts, ``expand`` of a size-1 axis): ``map`` traces a second plan for such
batches once, then runs them batched. Each round times one training step (forward +
backward) on every batch of two sets of lengths, the same lengths except that one
sample per batch has a single token; batches without one-row samples run first, so
the first one-row batch pays for its plan. Reported: median ms per step of each set
and their per-round ratio (target: one-row batches within 1.2x), the first one-row
step, the plans ``map`` holds for ``f``, whether every batch ran fully batched, and the warnings
raised (torch's C++ batching warnings included).

Usage: ``python -m benchmarks.one_row [--rounds 7] [--hidden 256] [--threads 1]
[--json PATH [--markdown PATH]]`` (``benchmarks/results/map/one_row.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch

import raggedfn
from benchmarks import plots
from benchmarks._standalone import cli, header

NORMAL = [[17, 30, 25, 12], [20, 9, 33, 14], [11, 27, 19, 22]]
ONE_ROW = [[1, 30, 25, 12], [20, 1, 33, 14], [11, 27, 1, 22]]


def make_f(hidden: int) -> tuple[Any, torch.nn.Module]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
    )
    model = transformers.BertModel(config).eval()

    def f(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids[None]).last_hidden_state[0]

    return f, model


def batch(lengths: list[int], seed: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (sum(lengths),), generator=gen)
    return raggedfn.from_lengths(ids, torch.tensor(lengths))


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    f, model = make_f(args.hidden)
    sets = {"normal": NORMAL, "one_row": ONE_ROW}
    batches = {k: [batch(lengths, i) for i, lengths in enumerate(v)] for k, v in sets.items()}

    def step(x: raggedfn.Ragged) -> float:
        start = time.perf_counter()
        raggedfn.map(f, x).values.square().sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in batches["normal"]:
            step(x)  # the first plan
        first = step(batches["one_row"][0])  # the second plan, traced once
        times: dict[str, list[float]] = {k: [] for k in sets}
        for r in range(args.rounds):
            for k in ("one_row", "normal") if r % 2 else ("normal", "one_row"):
                times[k].append(sum(step(x) for x in batches[k]) / len(batches[k]))
    reports = [raggedfn.map_report(f, x) for xs in batches.values() for x in xs]
    return {
        **header("one_row", args),
        "rounds": args.rounds,
        "hidden": args.hidden,
        "lengths": sets,
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "one_row_over_normal": statistics.median(
            b / a for a, b in zip(times["normal"], times["one_row"], strict=True)
        ),
        "first_one_row_ms": 1e3 * first,
        "plans": raggedfn.map_cache_info(f).plans,
        "fully_batched": all(r.fully_batched for r in reports),
        "warnings": sorted({f"{w.category.__name__}: {str(w.message)[:120]}" for w in caught}),
    }


def markdown(record: dict[str, Any]) -> str:
    ms = record["median_ms"]
    lines = [
        f"2-layer HF BERT (hidden {record['hidden']}), one training step per batch through "
        f"`map`, {record['threads']} thread(s), median of {record['rounds']} rounds",
        "",
        "| batches | lengths | ms per step | over batches without one-row samples |",
        "|---|---|---|---|",
        f"| without one-row samples | {record['lengths']['normal']} | {ms['normal']:.1f} | 1 |",
        f"| with one-row samples | {record['lengths']['one_row']} | {ms['one_row']:.1f} "
        f"| {record['one_row_over_normal']:.2f}x |",
        "",
        f"First one-row batch: {record['first_one_row_ms']:.0f} ms (map traces f on its sizes once); "
        f"plans held: {record['plans']}; every batch fully batched: "
        f"{'yes' if record['fully_batched'] else 'NO'}; warnings: "
        f"{'; '.join(record['warnings']) or 'none'}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256)
    return cli(parser, run, markdown, argv, plot=plots.plot_one_row)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
