"""Per-call overhead on tiny inputs and a GAT aggregation against PyG (issue #18).

Each *row* pairs raggedfn with what a user would call instead, on the same data:

- ``sum``: ``raggedfn.sum(x, 1)`` vs ``torch.segment_reduce(values, "sum", lengths=)``;
- ``softmax``: ``raggedfn.softmax(x, 1)`` vs PyG's ``torch_geometric.utils.softmax``
  (``index=``) where installed, else a per-sample loop of ``torch.softmax``;
- ``softmax_kernel``: the same ``raggedfn.softmax`` vs one unsegmented ``torch.softmax``
  of the values (the kernel-call unit of the issue's "3x the kernel" target);
- ``from_lengths``: the validated constructor vs ``torch.segment_reduce`` of the
  same lengths (one torch kernel call: the unit the issue's targets are written in);
- ``map``: a trivial ``raggedfn.map(lambda s: s * 2, x)`` vs ``values * 2``;
- ``softmax_unit`` / ``map_unit``: ``softmax`` and the trivial ``map`` vs
  ``torch.segment_reduce``, the unit the issue's targets are written in (sum <= 3, softmax
  <= 4.4, from_lengths <= 3.5, map <= 5.3 of it);
- ``gat_small`` / ``gat_large``: the GAT aggregation of ``examples/gat.py`` (segment
  softmax of the edge scores over each node's incoming edges, then the weighted
  segment sum of the messages), forward+backward, vs PyG's ``softmax`` + ``scatter``
  (300 nodes / 900 edges, 20k nodes / 200k edges; 4 heads of 16 channels).

Tiny inputs: 2 samples, 10 rows, 8 features. Method: one process,
``torch.set_num_threads(1)``; both calls of a row are checked to agree, warmed up,
then timed in ``--rounds`` rounds that alternate which goes first; each timed sample
repeats the call until it lasts ``--min-time``; the table gives medians (µs) and
the median of the per-round ratios ``raggedfn / other``. On CPU the clock is the
process's CPU time (``time.process_time``), not wall time: on a shared machine
wall time also counts the slices other processes ran in, which swamps
microsecond calls; with one thread all of torch's work runs in this process.

Run: ``python -m benchmarks.overhead [--rounds 15] [--only sum --only gat_small]``;
writes ``benchmarks/results/overhead/overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks import plots
from benchmarks.harness import machine

# not results/*.json: those are the harness suites' records (tests/test_harness.py reads them)
RESULTS = Path(__file__).resolve().parent / "results" / "overhead"


@dataclass
class Row:
    """One measured pair: medians in microseconds and the median per-round ratio."""

    name: str
    other: str
    raggedfn_us: float
    other_us: float
    ratio: float  # raggedfn / other, median of per-round ratios
    rounds: int


@dataclass
class Pair:
    """Two zero-argument calls computing the same thing, and how to compare their outputs."""

    name: str
    other: str
    ours: Callable[[], Any]
    theirs: Callable[[], Any]
    outputs: Callable[[Any], list[Tensor]]


def _tiny(device: str) -> tuple[Tensor, Tensor, raggedfn.Ragged]:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(10, 8, generator=gen).to(device)
    lengths = torch.tensor([4, 6], device=device)
    return values, lengths, raggedfn.from_lengths(values, lengths)


def _plain(out: Any) -> list[Tensor]:
    return [out.values if isinstance(out, raggedfn.Ragged) else out]


def tiny_pairs(device: str = "cpu") -> list[Pair]:
    """The per-call overhead rows (2 samples, 10 rows)."""
    values, lengths, x = _tiny(device)
    pairs = [
        Pair(
            "sum",
            "torch.segment_reduce",
            lambda: raggedfn.sum(x, 1),
            lambda: torch.segment_reduce(values, "sum", lengths=lengths),
            _plain,
        ),
        Pair(
            "softmax_kernel",
            "torch.softmax (unsegmented)",
            lambda: raggedfn.softmax(x, 1),
            lambda: torch.softmax(values, 0),
            lambda out: [],  # different results: the kernel-call unit only
        ),
        Pair(
            "from_lengths",
            "torch.segment_reduce",
            lambda: raggedfn.from_lengths(values, lengths),
            lambda: torch.segment_reduce(values, "sum", lengths=lengths),
            lambda out: [],  # different results: only the time is compared
        ),
        Pair(
            "map",
            "values * 2",
            lambda: raggedfn.map(lambda s: s * 2, x),
            lambda: values * 2,
            _plain,
        ),
        # the targets are written in this unit: 3x torch.segment_reduce's 5.7 µs
        # is sum's 17 µs; softmax's 25 µs is 4.4 units, map's 30 µs 5.3 units
        Pair(
            "softmax_unit",
            "torch.segment_reduce",
            lambda: raggedfn.softmax(x, 1),
            lambda: torch.segment_reduce(values, "sum", lengths=lengths),
            lambda out: [],  # different results: the unit only
        ),
        Pair(
            "map_unit",
            "torch.segment_reduce",
            lambda: raggedfn.map(lambda s: s * 2, x),
            lambda: torch.segment_reduce(values, "sum", lengths=lengths),
            lambda out: [],
        ),
    ]
    index = raggedfn.segment_ids(x)
    pyg = _pyg()
    if pyg is not None:
        pairs.insert(
            1,
            Pair(
                "softmax",
                "pyg softmax",
                lambda: raggedfn.softmax(x, 1),
                lambda: pyg.utils.softmax(values, index, num_nodes=2),
                _plain,
            ),
        )
    else:
        split = lengths.tolist()
        pairs.insert(
            1,
            Pair(
                "softmax",
                "loop torch.softmax",
                lambda: raggedfn.softmax(x, 1),
                lambda: torch.cat([v.softmax(0) for v in values.split(split)]),
                _plain,
            ),
        )
    return pairs


def _pyg() -> Any:
    try:
        with warnings.catch_warnings():
            # torch 2.13 deprecates torch.jit.script, which PyG calls while importing
            warnings.simplefilter("ignore", DeprecationWarning)
            import torch_geometric
            import torch_geometric.utils
    except ImportError:
        return None
    return torch_geometric


def gat_pair(name: str, nodes: int, edges: int, device: str = "cpu") -> Pair | None:
    """GAT aggregation fwd+bwd on a random graph, raggedfn vs PyG (``None`` without PyG)."""
    pyg = _pyg()
    if pyg is None:
        return None
    heads, channels = 4, 16
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(0, nodes, (edges,), generator=gen).sort().values.to(device)
    in_degree = torch.bincount(target, minlength=nodes)
    grouping = raggedfn.from_lengths(torch.zeros(edges, device=device), in_degree)
    scores = torch.randn(edges, heads, generator=gen).to(device).requires_grad_(True)
    messages = torch.randn(edges, heads, channels, generator=gen).to(device)
    messages.requires_grad_(True)
    cotangent = torch.randn(nodes, heads, channels, generator=gen).to(device)
    inputs = (scores, messages)

    def ours() -> tuple[Tensor, ...]:
        weights = raggedfn.softmax(grouping.with_values(scores), 1).values
        out = raggedfn.sum(grouping.with_values(weights.unsqueeze(-1) * messages), 1)
        return (out.detach(), *torch.autograd.grad(out, inputs, cotangent))

    def theirs() -> tuple[Tensor, ...]:
        weights = pyg.utils.softmax(scores, target, num_nodes=nodes)
        out = pyg.utils.scatter(weights.unsqueeze(-1) * messages, target, 0, nodes, reduce="sum")
        return (out.detach(), *torch.autograd.grad(out, inputs, cotangent))

    return Pair(name, "pyg softmax + scatter", ours, theirs, list)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(call: Callable[[], Any], number: int, device: str) -> float:
    # CPU time of this process on CPU: on the shared machine wall time also counts the
    # slices other processes ran in (one thread: all of torch's work is in it)
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    _sync(device)
    start = clock()
    for _ in range(number):
        call()
    _sync(device)
    return (clock() - start) / number


def _number(call: Callable[[], Any], min_time: float, device: str) -> int:
    once = statistics.median(_time(call, 1, device) for _ in range(5))
    return max(1, min(20000, round(min_time / max(once, 1e-7))))


def check(pair: Pair) -> None:
    """Raise ``AssertionError`` unless both calls of ``pair`` compute the same outputs."""
    ours, theirs = pair.outputs(pair.ours()), pair.outputs(pair.theirs())
    assert len(ours) == len(theirs), pair.name
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{pair.name}: {m}")


def measure(pair: Pair, rounds: int, min_time: float, device: str = "cpu") -> Row:
    """Check, warm up and time ``pair`` in alternating rounds."""
    check(pair)
    for _ in range(3):
        pair.ours()
        pair.theirs()
    n_ours = _number(pair.ours, min_time, device)
    n_theirs = _number(pair.theirs, min_time, device)
    ours: list[float] = []
    theirs: list[float] = []
    for r in range(rounds):
        if r % 2:
            ours.append(_time(pair.ours, n_ours, device))
            theirs.append(_time(pair.theirs, n_theirs, device))
        else:
            theirs.append(_time(pair.theirs, n_theirs, device))
            ours.append(_time(pair.ours, n_ours, device))
    ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
    return Row(
        pair.name,
        pair.other,
        round(1e6 * statistics.median(ours), 2),
        round(1e6 * statistics.median(theirs), 2),
        round(ratio, 3),
        rounds,
    )


def all_pairs(device: str = "cpu", gat: bool = True) -> list[Pair]:
    pairs = tiny_pairs(device)
    if gat:
        for name, nodes, edges in (("gat_small", 300, 900), ("gat_large", 20_000, 200_000)):
            got = gat_pair(name, nodes, edges, device)
            if got is not None:
                pairs.append(got)
    return pairs


def markdown(rows: Sequence[Row]) -> str:
    lines = [
        "| row | other | raggedfn (µs) | other (µs) | raggedfn / other |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.other} | {r.raggedfn_us:.1f} | {r.other_us:.1f} | {r.ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-time", type=float, default=0.02, help="seconds per timed sample")
    parser.add_argument("--only", action="append", help="only these rows")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pairs = [p for p in all_pairs(args.device) if not args.only or p.name in args.only]
    rows = [measure(p, args.rounds, args.min_time, args.device) for p in pairs]
    text = markdown(rows)
    print(text)
    if args.only:
        return 0
    stem = "overhead" + ("" if args.device == "cpu" else f"-{args.device}")
    record = {
        "command": " ".join(["python -m benchmarks.overhead", *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "threads": args.threads,
        "device": args.device,
        "machine": machine(),
        "rows": [asdict(r) for r in rows],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(text + "\n")
    plots.plot_overhead(record, args.out / f"{stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
