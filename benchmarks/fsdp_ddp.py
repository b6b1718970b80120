"""FSDP2 with every block sharded inside ``raggedfn.map`` against DDP, on 2 CPU processes.

The model (the same in both systems, built from the same seed): a token embedding on
the packed values, ``--blocks`` ``nn.TransformerEncoderLayer`` blocks (pre-norm, no
dropout) run on each sequence inside ``raggedfn.map`` (attention within the sequence,
no padding), the mean of the sequence, a linear head; loss = the sum of squares of
the head's outputs, divided by the number of samples of all ranks (DDP and FSDP2
average gradients over the ranks: one process on the union batch). Adam.

Systems, side by side in the same 2 gloo processes (``torch.multiprocessing.spawn``,
file rendezvous, ``--threads`` threads each), each rank holding its own batch of
``--batch`` lognormal lengths (the harness's ``lognormal``, scaled to mean
``--mean-length``):

- ``fsdp``: ``fully_shard`` on every block, then on the root (embedding and head);
  ``map`` gathers each block once per call for the whole batch.
- ``ddp``: ``DistributedDataParallel(model, gradient_as_bucket_view=True)`` (the
  gradients are views into DDP's all-reduce buckets: no second gradient-sized copy).

A reference pair, timed in the same rounds: ``plain_fsdp`` and ``plain_ddp``, the same
two wrappings of the same blocks run without ``map`` on the rank's packed tokens as one
sequence (``[1, T, hidden]``: the same token count through every linear layer, attention
across the samples, so not the same model). Their ratio is what FSDP2 costs over DDP at
this amount of work without raggedfn: the part of the ``fsdp / ddp`` ratio that is
FSDP2's own.

Measured per rank:

- **state**: the bytes of parameters, gradients and Adam's state a rank holds after a
  step (FSDP2's DTensors counted by their local shard, ``to_local()``), and the same
  counted as distinct storages (FSDP2's padded shards, DDP's buckets).
- **peak RSS**: torch has no CPU allocator statistics, so this is the process's peak
  resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) above its RSS
  before the system is built, over building it and two steps (and the RSS it still
  holds after them), each system alone (the other freed first;
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the RSS), measured in
  both orders (``--memory-orders 2``) and the larger value kept.
- **step time**: zero_grad, forward, backward, ``optimizer.step()``, started on both
  ranks by a barrier; the slower rank's time. One warm-up step per system (whose
  losses are recorded: both systems must give the same loss), then ``--rounds``
  rounds in an order rotated from round to round (``_standalone.rotated_rounds``);
  medians, and the ratio as the median of per-round ratios.
- **collectives**: FSDP2's and DDP's collectives alone on the parameters' bytes
  (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``), to set
  the step-time difference against what the extra communication costs.

Targets (reported, not asserted): per-rank parameter + gradient + optimizer bytes at
most 0.6x DDP's, step time within 1.3x of DDP's.

Run: ``python -m benchmarks.fsdp_ddp [--quick] [--rounds 7] [--json
benchmarks/results/fsdp_ddp/fsdp_ddp.json --markdown benchmarks/results/fsdp_ddp/fsdp_ddp.md]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import raggedfn
from benchmarks import plots
from benchmarks._cases import DISTRIBUTIONS
from benchmarks._standalone import cli, header, rotated_rounds

WORLD = 2
SYSTEMS = ("fsdp", "ddp")
PLAIN = ("plain_fsdp", "plain_ddp")  # the reference pair: no map (timing only)
TARGETS = {"state_ratio": 0.6, "time_ratio": 1.3}
ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Size:
    blocks: int
    hidden: int
    heads: int
    ff: int
    batch: int  # samples per rank
    mean: int  # mean length (the harness's lognormal, scaled)
    vocab: int

    def lengths(self) -> list[list[int]]:
        """Each rank's lengths: consecutive slices of one draw."""
        drawn = DISTRIBUTIONS["lognormal"].lengths(WORLD * self.batch, scale=self.mean / 128)
        return [drawn[r * self.batch : (r + 1) * self.batch] for r in range(WORLD)]


FULL = Size(blocks=4, hidden=512, heads=8, ff=2048, batch=8, mean=32, vocab=256)
QUICK = Size(blocks=4, hidden=128, heads=4, ff=512, batch=4, mean=16, vocab=64)


class Model(torch.nn.Module):
    """Embedding, ``blocks`` encoder layers per sequence inside ``map``, mean, head."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(size.vocab, size.hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                size.hidden, size.heads, size.ff, dropout=0.0, norm_first=True
            )
            for _ in range(size.blocks)
        )
        self.head = torch.nn.Linear(size.hidden, 1)

    def forward(self, tokens: raggedfn.Ragged, scale: float) -> torch.Tensor:
        embedded = tokens.with_values(self.embed(tokens.values))
        blocks = self.blocks  # what f reaches: map gathers the sharded blocks it finds

        def per_sample(x: torch.Tensor) -> torch.Tensor:  # [N, hidden]: one sequence
            for block in blocks:
                x = block(x)
            return x.mean(0)

        return (self.head(raggedfn.map(per_sample, embedded)) ** 2).sum() * scale


class PlainModel(Model):
    """The same blocks without ``map``: the packed tokens as one sequence ``[1, T, hidden]``
    (attention across the samples), for the reference pair's timing only."""

    def forward(self, tokens: raggedfn.Ragged, scale: float) -> torch.Tensor:
        x = self.embed(tokens.values)[None]
        for block in self.blocks:
            x = block(x)
        return (self.head(x[0]) ** 2).sum() * scale


@dataclasses.dataclass
class System:
    model: Model
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def step(self, tokens: raggedfn.Ragged, scale: float) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = self.wrapped(tokens, scale)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def build(name: str, size: Size) -> System:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)  # the same initial weights in both systems, on every rank
    model = PlainModel(size) if name in PLAIN else Model(size)
    wrapped: torch.nn.Module
    if name.endswith("fsdp"):
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)  # every block its own unit
        fully_shard(model, mesh=mesh)  # the root: embedding and head
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
    return System(model, wrapped, torch.optim.Adam(model.parameters(), lr=1e-4))


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: this rank's shard
    return to_local() if to_local is not None else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(system: System) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds: tensor bytes (local
    shards) per kind, their total, and the bytes of the distinct storages behind them."""
    params = [_local(p) for p in system.model.parameters()]
    grads = [_local(p.grad) for p in system.model.parameters() if p.grad is not None]
    optim = [
        _local(v)
        for state in system.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in params + grads + optim
    }
    counts = {"params": _bytes(params), "grads": _bytes(grads), "optimizer": _bytes(optim)}
    return counts | {"total": sum(counts.values()), "storages": sum(storages.values())}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss(name: str, size: Size, tokens: raggedfn.Ragged, scale: float) -> dict[str, Any]:
    """``name`` alone: its peak RSS above the RSS before it was built, over building it
    and two steps (MiB), and the state it holds after them."""
    gc.collect()
    dist.barrier()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak mark := current RSS
    system = build(name, size)
    for _ in range(2):  # the second step holds gradients and Adam's state from the start
        system.step(tokens, scale)
    out = {
        "peak_rss_mib": (_status_kib("VmHWM") - before) / 1024,
        "held_rss_mib": (_status_kib("VmRSS") - before) / 1024,
        "state": state_bytes(system),
    }
    dist.barrier()
    del system
    gc.collect()
    return out


def _tokens(lengths: list[int], vocab: int, rank: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(100 + rank)
    return raggedfn.from_lengths(
        torch.randint(0, vocab, (sum(lengths),), generator=gen), torch.tensor(lengths)
    )


def _timed(system: System, tokens: raggedfn.Ragged, scale: float) -> Callable[[], float]:
    """One step started on both ranks together; the slower rank's seconds."""

    return lambda: _timed_call(lambda: system.step(tokens, scale))


def _max_difference(fsdp: Model, ddp: Model) -> float:
    """Largest difference of the two models' parameters (FSDP2's gathered)."""
    worst = 0.0
    for a, b in zip(fsdp.parameters(), ddp.parameters(), strict=True):
        full = a.full_tensor() if hasattr(a, "full_tensor") else a  # type: ignore[operator]
        worst = max(worst, float((full.detach() - b.detach()).abs().max()))
    return worst


def collectives(numel: int, rounds: int) -> dict[str, float]:
    """Milliseconds (medians, the slower rank's) of the collectives each system makes on
    all the parameters' float32 bytes, alone: FSDP2 all-gathers them twice (forward,
    backward) and reduce-scatters the gradients; DDP all-reduces the gradients."""
    shard = torch.randn(-(-numel // WORLD))
    full = torch.empty(shard.numel() * WORLD)
    calls: dict[str, Callable[[], Any]] = {
        "all_gather": lambda: dist.all_gather_single(full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
        "all_reduce": lambda: dist.all_reduce(full),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds + 1):  # round 0 warms up
        for name, call in calls.items():
            seconds = _timed_call(call)
            if r:
                times[name].append(1e3 * seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def _timed_call(call: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    call()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def measure(rank: int, size: Size, rounds: int, orders: int) -> dict[str, Any]:
    lengths = size.lengths()
    tokens = _tokens(lengths[rank], size.vocab, rank)
    scale = WORLD / sum(len(ls) for ls in lengths)  # mean over the union's samples
    out: dict[str, Any] = {"rank": rank, "tokens": sum(lengths[rank])}
    started = time.perf_counter()
    # timing: both systems built, the same batch, steps alternated
    systems = {name: build(name, size) for name in SYSTEMS}
    fsdp = systems["fsdp"].model
    # each block its own FSDP2 unit (not only sharded by the root's), holding a shard
    out["blocks_sharded"] = [
        isinstance(block, FSDPModule)
        and all(isinstance(p, DTensor) for p in block.parameters())
        and _bytes(_local(p) for p in block.parameters()) < _bytes(block.parameters())
        for block in fsdp.blocks
    ]
    out["parameters"] = sum(_local(p).numel() for p in systems["ddp"].model.parameters())
    out["loss_step1"] = {name: float(s.step(tokens, scale)) for name, s in systems.items()}
    plain = {name: build(name, size) for name in PLAIN}
    out["plain_loss_step1"] = {name: float(s.step(tokens, scale)) for name, s in plain.items()}
    runs = {name: _timed(s, tokens, scale) for name, s in (systems | plain).items()}
    timed = rotated_rounds(runs, rounds, ours="fsdp", also=("plain_fsdp",))
    out["median_ms"] = timed["median_ms"]
    out["fsdp_over_ddp"] = timed["raggedfn_over"]["ddp"]
    out["plain_fsdp_over_ddp"] = timed["plain_fsdp_over"]["plain_ddp"]
    out["max_parameter_difference"] = _max_difference(fsdp, systems["ddp"].model)
    del systems, plain, runs, fsdp
    out["collectives_ms"] = collectives(out["parameters"], rounds)
    out["timing_seconds"] = round(time.perf_counter() - started, 2)
    # peak RSS, each system alone (after the timing: first-call allocations are done),
    # in both orders: the larger value
    memory: dict[str, dict[str, Any]] = {}
    for name in (*SYSTEMS, *SYSTEMS[::-1])[: len(SYSTEMS) * orders]:
        got = peak_rss(name, size, tokens, scale)
        if name not in memory or got["peak_rss_mib"] > memory[name]["peak_rss_mib"]:
            memory[name] = got
    out["memory"] = memory
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def _worker(rank: int, init_file: str, out_dir: str, size: Size, args: dict) -> None:
    torch.set_num_threads(args["threads"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        result = measure(rank, size, args["rounds"], args["orders"])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        gc.collect()  # DDP before the process group (docs/distributed.md)
        dist.destroy_process_group()


def run_ranks(size: Size, rounds: int, threads: int, orders: int = 2) -> list[dict[str, Any]]:
    """Spawn the 2 gloo processes (this checkout's raggedfn on their path); each
    rank's result."""
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned processes inherit it
    try:
        with tempfile.TemporaryDirectory() as directory:
            mp.spawn(
                _worker,
                args=(
                    os.path.join(directory, "rendezvous"),
                    directory,
                    size,
                    {"rounds": rounds, "threads": threads, "orders": orders},
                ),
                nprocs=WORLD,
            )
            return [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(WORLD)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = QUICK if args.quick else FULL
    overrides = {k: getattr(args, k) for k in ("blocks", "hidden", "heads", "ff", "batch", "mean")}
    size = dataclasses.replace(size, **{k: v for k, v in overrides.items() if v is not None})
    load_before = os.getloadavg()
    started = time.perf_counter()
    ranks = run_ranks(size, args.rounds, args.threads, args.memory_orders)
    state = {name: [r["memory"][name]["state"]["total"] for r in ranks] for name in SYSTEMS}
    storages = {name: [r["memory"][name]["state"]["storages"] for r in ranks] for name in SYSTEMS}
    peak = {name: [r["memory"][name]["peak_rss_mib"] for r in ranks] for name in SYSTEMS}
    # the rank with the most state against DDP's (the same on every rank)
    ratios = {
        "state_ratio": max(state["fsdp"]) / max(state["ddp"]),
        "storage_ratio": max(storages["fsdp"]) / max(storages["ddp"]),
        # none where DDP's step grows the RSS by less than a MiB (tiny sizes)
        "peak_rss_ratio": max(peak["fsdp"]) / max(peak["ddp"]) if max(peak["ddp"]) >= 1 else None,
        "time_ratio": ranks[0]["fsdp_over_ddp"],  # the same on both ranks (slower rank's)
        "plain_time_ratio": ranks[0]["plain_fsdp_over_ddp"],
    }
    return {
        **header("fsdp_ddp", args),
        "quick": args.quick,
        "world": WORLD,
        "size": dataclasses.asdict(size),
        "lengths": size.lengths(),
        "rounds": args.rounds,
        "targets": TARGETS,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "ranks": ranks,
        **ratios,
        "memory_orders": args.memory_orders,
        "meets_targets": {k: ratios[k] <= t for k, t in TARGETS.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _held_ratio(record: dict[str, Any]) -> float | None:
    held = {n: max(r["memory"][n]["held_rss_mib"] for r in record["ranks"]) for n in SYSTEMS}
    return held["fsdp"] / held["ddp"] if held["ddp"] >= 1 else None


def markdown(record: dict[str, Any]) -> str:
    s = record["size"]
    r0 = record["ranks"][0]
    lines = [
        f"{s['blocks']} blocks (nn.TransformerEncoderLayer, hidden {s['hidden']}, "
        f"{s['heads']} heads, feed-forward {s['ff']}) per sample inside raggedfn.map, "
        f"{r0['parameters'] / 1e6:.2f} M parameters, float32, Adam; {record['world']} gloo "
        f"processes, {record['threads']} thread(s) each, B = {s['batch']} per rank, lengths "
        f"{record['lengths']}; median of {record['rounds']} rounds; load average "
        f"{record['load_average']['before'][0]:.1f} before, "
        f"{record['load_average']['after'][0]:.1f} after",
        "",
        "| system | step ms | params MiB | grads MiB | Adam MiB | state MiB | state storages "
        "MiB | RSS held after MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SYSTEMS:
        cells = [rank["memory"][name] for rank in record["ranks"]]
        worst = max(cells, key=lambda c: c["state"]["total"])
        st = worst["state"]
        lines.append(
            f"| {name} | {r0['median_ms'][name]:.1f} | {st['params'] / MIB:.2f} | "
            f"{st['grads'] / MIB:.2f} | {st['optimizer'] / MIB:.2f} | {st['total'] / MIB:.2f} | "
            f"{st['storages'] / MIB:.2f} | {max(c['held_rss_mib'] for c in cells):.1f} | "
            f"{max(c['peak_rss_mib'] for c in cells):.1f} |"
        )
    t = record["targets"]
    met = record["meets_targets"]
    lines += [
        f"| fsdp / ddp | {record['time_ratio']:.2f}x | | | | {record['state_ratio']:.3f}x | "
        f"{record['storage_ratio']:.3f}x | {_ratio(_held_ratio(record))} | "
        f"{_ratio(record['peak_rss_ratio'])} |",
        "",
        f"Targets: state (parameters + gradients + Adam, per rank) <= {t['state_ratio']}x DDP's: "
        f"{record['state_ratio']:.3f}x, {'met' if met['state_ratio'] else 'NOT met'}; step time "
        f"<= {t['time_ratio']}x DDP's: {record['time_ratio']:.2f}x, "
        f"{'met' if met['time_ratio'] else 'NOT met'}. Step-1 losses (rank 0): fsdp "
        f"{r0['loss_step1']['fsdp']:.9g}, ddp {r0['loss_step1']['ddp']:.9g}; largest parameter "
        f"difference after {record['rounds'] + 2} steps: {r0['max_parameter_difference']:.2g}.",
    ]
    plain = record.get("plain_time_ratio")
    if plain is not None:
        ms = r0["median_ms"]
        lines += [
            "",
            f"Without raggedfn, for reference (the same blocks on the rank's packed tokens as "
            f"one sequence, no map): FSDP2 {ms['plain_fsdp']:.1f} ms, DDP "
            f"{ms['plain_ddp']:.1f} ms per step, FSDP2 / DDP {plain:.2f}x, against "
            f"{record['time_ratio']:.2f}x with the blocks inside map.",
        ]
    c = r0.get("collectives_ms")
    if c:
        extra = 2 * c["all_gather"] + c["reduce_scatter"] - c["all_reduce"]
        lines += [
            "",
            f"The collectives alone on all {r0['parameters'] / 1e6:.2f} M float32 parameters "
            f"(medians, ms): all_gather {c['all_gather']:.1f}, "
            f"reduce_scatter {c['reduce_scatter']:.1f}, all_reduce {c['all_reduce']:.1f}: "
            f"FSDP2's two gathers and one reduce-scatter cost {extra:.0f} ms more per step than "
            f"DDP's all-reduce (measured step difference "
            f"{r0['median_ms']['fsdp'] - r0['median_ms']['ddp']:.0f} ms).",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="hidden 128, B 4, mean length 16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--memory-orders", type=int, default=2, choices=(1, 2), help="peak RSS: fsdp first, ddp too"
    )
    for name in ("blocks", "hidden", "heads", "ff", "batch", "mean"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"override {name}")
    return cli(parser, run, markdown, argv, plot=plots.plot_fsdp_ddp)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
