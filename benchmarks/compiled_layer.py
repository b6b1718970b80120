"""One BERT layer, fwd+bwd: ``raggedfn.map`` eager vs compiled, and the hand-written layer.

The layer is ``benchmarks/bert.py``'s post-norm encoder layer at one of its scales
(``--scale tiny``: hidden 128, 2 heads; ``mini``: 256, 4), on a batch of harness
``lognormal`` lengths (``--batch``, ``--length-scale``: the ``make bench`` BERT sizes by
default). Systems, every one differentiating w.r.t. the input and every parameter:

- ``map``: ``raggedfn.map(layer_sample, x, params)`` (ordinary torch code for one sample);
- ``map compiled``: a function of the packed fields and the parameters calling that
  ``map``, under ``torch.compile(fullgraph=True, dynamic=True)`` (inductor);
- ``raggedfn`` / ``raggedfn compiled``: the layer written with raggedfn's ops, eager and
  compiled the same way (what compile gives without ``map`` in between);
- ``padded`` / ``padded compiled``: plain torch on the zero-padded ``[B, N_max, D]`` batch
  with a boolean key mask (``bert.layer_batched``), the packed rows scattered in and
  gathered out: what compile and its first call cost without raggedfn at all.

``--systems`` picks some of them (``map raggedfn padded``); run each alone, in its own
process with its own empty ``TORCHINDUCTOR_CACHE_DIR``, for a cold first compile that
shares no kernel with another system's.

Each round runs every system once, in rotated order; the table gives the median and
the minimum over rounds (on a loaded machine the minimum is the steadier estimate of a
system's own cost) and each compiled system's speedup over the same system eager (the
median of per-round ratios, and the ratio of minima). The first compiled call's
seconds (dynamo + AOTAutograd + inductor, forward and backward) are broken down with
``torch._dynamo.utils.compile_times()`` (phases overlap: C++
compilation runs inside codegen and in worker processes); ``--profile`` adds a ``torch.profiler`` table
per system. Set ``TORCHINDUCTOR_CACHE_DIR`` to an empty folder for a cold compile.

Run: ``python -m benchmarks.compiled_layer [--scale mini] [--rounds 21] [--profile]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch._dynamo.utils import counters

import raggedfn
from benchmarks import bert, plots
from benchmarks._cases import DISTRIBUTIONS

# what a first compile spends its time on (names of torch._dynamo.utils.compile_times())
PHASES = {
    "total": "_compile.compile_inner",
    "dynamo: bytecode tracing": "bytecode_tracing",
    "AOTAutograd: joint graph": "aot_trace_joint_graph",
    "inductor forward": "compile_fx.<locals>.fw_compiler_base",
    "inductor backward": "compile_fx.<locals>.bw_compiler",
    "inductor: codegen": "GraphLowering.codegen",
    "inductor: C++ compile and load": "compile_file",
    "guards": "build_guards",
}


SYSTEMS = ("map", "raggedfn", "padded")


def compile_phases() -> dict[str, float]:
    """Seconds per phase of the compiles so far (what ``compile_times`` prints, summed)."""
    times = torch._dynamo.utils.compilation_time_metrics
    return {label: float(sum(times.get(key, []))) for label, key in PHASES.items()}


def systems(scale: str, x: raggedfn.Ragged) -> dict[str, Callable[..., Tensor]]:
    heads = bert.SCALES[scale][2]
    layout = x.layout
    batch, longest, dim = x.batch_size, int(x.lengths.max()), x.values.shape[-1]
    keep = raggedfn.mask(x)  # [B, N_max] True at real tokens
    rows = keep.reshape(-1).nonzero().squeeze(1)  # each packed row's place in [B * N_max]
    key_mask = keep[:, None, None, :]

    def layer_sample(t: Tensor, p: dict[str, Tensor]) -> Tensor:
        return bert.layer_sample(t, p, heads)

    def mapped(values: Tensor, offsets: Tensor, sizes: Tensor, p: dict[str, Tensor]) -> Tensor:
        y = raggedfn.Ragged(values, offsets, sizes, layout)
        return raggedfn.map(layer_sample, y, p, in_dims=(0, None)).values

    def hand_written(
        values: Tensor, offsets: Tensor, sizes: Tensor, p: dict[str, Tensor]
    ) -> Tensor:
        return bert.layer_ragged(raggedfn.Ragged(values, offsets, sizes, layout), p, heads).values

    def padded(values: Tensor, offsets: Tensor, sizes: Tensor, p: dict[str, Tensor]) -> Tensor:
        flat = values.new_zeros(batch * longest, dim).index_copy(0, rows, values)
        y = bert.layer_batched(flat.view(batch, longest, dim), p, heads, key_mask)
        return y.reshape(-1, dim).index_select(0, rows)

    return {"map": mapped, "raggedfn": hand_written, "padded": padded}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch._dynamo.config.capture_scalar_outputs = True
    dim = bert.SCALES[args.scale][1]
    lengths = DISTRIBUTIONS["lognormal"].lengths(args.batch, args.length_scale)
    gen = torch.Generator().manual_seed(0)
    params = bert.layer_params(bert.make_params(1, dim, gen, torch.float32), 0)
    params = {k: v.requires_grad_() for k, v in params.items()}
    values = torch.randn(sum(lengths), dim, generator=gen).requires_grad_()
    x = raggedfn.from_lengths(values, torch.tensor(lengths))
    cotangent = torch.randn(sum(lengths), dim, generator=gen)
    leaves = [values, *params.values()]
    fns = {name: fn for name, fn in systems(args.scale, x).items() if name in args.systems}
    reference = systems(args.scale, x)["raggedfn"]

    def step(fn: Callable[..., Tensor]) -> float:
        start = time.perf_counter()
        out = fn(values, x.offsets, x.sizes, params)
        torch.autograd.grad(out, leaves, cotangent)
        return time.perf_counter() - start

    if "map" in fns:
        step(fns["map"])  # map's eager trace
    first: dict[str, float] = {}
    graphs: dict[str, int] = {}
    phases: dict[str, dict[str, float]] = {}
    for name in list(fns):
        torch._dynamo.reset()
        counters.clear()
        before = compile_phases()
        compiled = torch.compile(fns[name], fullgraph=True, dynamic=True, backend=args.backend)
        first[name] = round(step(compiled), 1)
        graphs[name] = counters["stats"]["unique_graphs"]
        after = compile_phases()
        phases[name] = {k: round(after[k] - before[k], 1) for k in after}
        with torch.no_grad():
            torch.testing.assert_close(
                compiled(values, x.offsets, x.sizes, params),
                reference(values, x.offsets, x.sizes, params),
                rtol=1e-4,
                atol=1e-4,
            )
        fns[f"{name} compiled"] = compiled
    for fn in fns.values():
        step(fn)
        step(fn)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(step(fns[name]))
    record: dict[str, Any] = {
        "scale": args.scale,
        "systems": list(args.systems),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "backend": args.backend,
        "lengths": lengths,
        "threads": args.threads,
        "rounds": args.rounds,
        "first_call_s": first,
        "graphs": graphs,
        "compile_phases_s": phases,
        "median_ms": {n: round(statistics.median(t) * 1e3, 2) for n, t in times.items()},
        "min_ms": {n: round(min(t) * 1e3, 2) for n, t in times.items()},
        "compiled_over_eager": {},
    }
    for name in args.systems:
        eager, compiled = times[name], times[f"{name} compiled"]
        record["compiled_over_eager"][name] = {
            "median_of_ratios": round(
                statistics.median(a / b for a, b in zip(eager, compiled, strict=True)), 3
            ),
            "ratio_of_minima": round(min(eager) / min(compiled), 3),
        }
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        record["profiles"] = {}
        for name, fn in fns.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step(fn)
            record["profiles"][name] = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=15
            )
    return record


# what each run measures per system (merged by system into an earlier record of the same case)
PER_SYSTEM = ("first_call_s", "graphs", "compile_phases_s", "compiled_over_eager")
PER_STEP = ("median_ms", "min_ms")


def write(record: dict[str, Any], path: Path) -> None:
    """Write ``record`` to ``path`` and its plot beside it. A record already there for the
    same case (scale, lengths, threads, backend) keeps its other systems: run each system
    alone, in its own process with an empty inductor cache, into one file. Ratios are
    within one run (a system against itself eager); times across runs are not side by
    side."""
    case = ("scale", "lengths", "threads", "backend")
    if path.exists():
        old = json.loads(path.read_text())
        if all(old.get(key) == record[key] for key in case):
            runs = [r for r in old.get("runs", [old]) if r["systems"] != record["systems"]]
            merged = dict(old)
            merged["runs"] = [*runs, {k: v for k, v in record.items() if k != "runs"}]
            merged["systems"] = list(dict.fromkeys(s for r in merged["runs"] for s in r["systems"]))
            for key in (*PER_SYSTEM, *PER_STEP):
                merged[key] = {k: v for r in merged["runs"] for k, v in r[key].items()}
            record = merged
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    plots.plot_compiled_layer(record, path.with_suffix(".png"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length-scale", type=float, default=0.125)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--json", help="write the record here")
    parser.add_argument(
        "--systems", nargs="+", default=["map", "raggedfn", "padded"], choices=SYSTEMS
    )
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record = run(args)
    if args.json:
        write(record, Path(args.json))
    print(f"{args.scale} layer, lengths {record['lengths']}, {args.threads} thread(s)")
    print("| system | median ms | min ms |\n|---|---|---|")
    for name, ms in record["median_ms"].items():
        print(f"| {name} | {ms} | {record['min_ms'][name]} |")
    print("compiled over eager:", record["compiled_over_eager"])
    print("first compiled call (s):", record["first_call_s"], "graphs:", record["graphs"])
    print("compile phases (s):", record["compile_phases_s"])
    for name, table in record.get("profiles", {}).items():
        print(f"--- {name}\n{table}")
    return record


if __name__ == "__main__":
    main()
