"""``raggedfn.map`` of a per-sample BERT-style layer vs padded and hand-written ragged code.

Systems (same ``torch.nn.TransformerEncoderLayer`` parameters everywhere):

- ``map``: ``raggedfn.map(bert, x, params)`` where ``bert`` runs the layer on one
  sample ``(N, D)`` as a batch of one (``functional_call``);
- ``padded``: the layer on ``[B, N_max, D]`` with ``src_key_padding_mask`` (eager);
- ``padded compiled``: the same under ``torch.compile`` (inductor, static shapes);
- ``hand-written``: the layer written with raggedfn ops (``linear``, ``attention``,
  ``layer_norm``) on the packed batch.

Usage: ``python -m benchmarks.map_bert [--quick] [--threads 1] [--repeats 5]
[--no-compile] [--json PATH [--markdown PATH]]``. Prints a markdown table (median ms;
ratios are medians of per-round ratios, every system once per round in an order
rotated from round to round) and the trace time of ``map`` per signature; with
``--json`` writes the record and its plot (``benchmarks/results/map/``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import raggedfn
from benchmarks import plots
from benchmarks._standalone import cli, header
from benchmarks.harness import DISTRIBUTIONS
from raggedfn._map.caching import _cache
from raggedfn._map.caching import _lookup as map_lookup

D_MODEL, HEADS, FF = 256, 4, 1024


def make_layer(dtype: torch.dtype = torch.float32) -> torch.nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
    return layer.to(dtype)


def per_sample(layer: torch.nn.Module) -> Callable[..., Any]:
    def bert(t: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(layer, params, (t[None],))[0]

    return bert


def hand_written(x: raggedfn.Ragged, p: dict[str, torch.Tensor]) -> raggedfn.Ragged:
    """The post-norm encoder layer written with raggedfn ops."""
    qkv = raggedfn.linear(x, p["self_attn.in_proj_weight"], p["self_attn.in_proj_bias"])
    values = qkv.values.reshape(-1, 3, HEADS, D_MODEL // HEADS)
    q, k, v = (x.with_values(values[:, i]) for i in range(3))
    # with_values on a standard layout adapts the dense axes: (B, N*, H, Dh)
    attended = raggedfn.attention(q, k, v)
    merged = x.with_values(attended.values.reshape(-1, D_MODEL))
    out = raggedfn.linear(merged, p["self_attn.out_proj.weight"], p["self_attn.out_proj.bias"])
    h = raggedfn.layer_norm(x + out, D_MODEL, p["norm1.weight"], p["norm1.bias"])
    ff = raggedfn.linear(h, p["linear1.weight"], p["linear1.bias"])
    ff = ff.with_values(F.relu(ff.values))
    ff = raggedfn.linear(ff, p["linear2.weight"], p["linear2.bias"])
    return raggedfn.layer_norm(h + ff, D_MODEL, p["norm2.weight"], p["norm2.bias"])


def lookup_cost(f: Any, x: raggedfn.Ragged, params: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Median microseconds of a warm cache lookup of ``map`` and of the dependency
    check inside it (what f reads: module flags, numbers, the captured tensors)."""
    args = (x, params)
    dims, leaves, treespec, kinds, _ = map_lookup.prepare("map", args, (0, None))
    map_lookup.lookup(f, leaves, kinds, treespec, dims)
    variant, _, _, _ = map_lookup.lookup(f, leaves, kinds, treespec, dims)
    roots = [r for r, _ in map_lookup.roots_of(f, leaves, kinds)]
    lifted: list[Any] = [None] * len(variant.deps.lifted)

    def per_call(run: Callable[[], Any], count: int = 200) -> float:
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(count):
                run()
            samples.append((time.perf_counter() - start) / count * 1e6)
        return statistics.median(samples)

    lookup = per_call(lambda: map_lookup.lookup(f, leaves, kinds, treespec, dims))
    check = per_call(lambda: variant.deps.check(*roots, lifted))
    return lookup, check


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    scale = 0.25 if args.quick else 1.0
    lengths = DISTRIBUTIONS["lognormal"].lengths(args.batch, scale)
    total, longest = sum(lengths), max(lengths)
    gen = torch.Generator().manual_seed(0)
    x = raggedfn.from_lengths(torch.randn(total, D_MODEL, generator=gen), torch.tensor(lengths))
    padded = raggedfn.to_padded(x)
    key_padding = ~raggedfn.mask(x)
    layer = make_layer()
    params = {k: v.detach() for k, v in layer.named_parameters()}
    bert = per_sample(layer)

    _cache.clear()
    start = time.perf_counter()
    raggedfn.map(bert, x, params, in_dims=(0, None))
    first_call = time.perf_counter() - start
    report = raggedfn.map_report(
        bert, x.to(torch.float64), {k: v.double() for k, v in params.items()}, in_dims=(0, None)
    )
    second_trace = report.trace_seconds
    assert raggedfn.map_report(bert, x, params, in_dims=(0, None)).fully_batched

    # agreement of every system with the padded layer (forward)
    with torch.no_grad():
        reference = layer(padded, src_key_padding_mask=key_padding)
        expect = raggedfn.from_padded(reference, x.lengths).values
        for name, got in (
            ("map", raggedfn.map(bert, x, params, in_dims=(0, None)).values),
            ("hand-written", hand_written(x, params).values),
        ):
            torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4, msg=name)

    trainable = {k: v.clone().requires_grad_() for k, v in params.items()}

    def fwd_bwd(loss: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            value = loss()
            torch.autograd.grad(value, list(trainable.values()))

        return run

    def padded_loss(module: Callable[..., torch.Tensor] | None) -> Callable[[], torch.Tensor]:
        def loss() -> torch.Tensor:
            out = (
                torch.func.functional_call(
                    layer, trainable, (padded,), {"src_key_padding_mask": key_padding}
                )
                if module is None
                else module(padded, key_padding)
            )
            return (out.masked_fill(key_padding[..., None], 0) ** 2).sum()

        return loss

    systems: dict[str, dict[str, Callable[[], Any]]] = {
        "map": {
            "fwd": lambda: raggedfn.map(bert, x, params, in_dims=(0, None)),
            "fwd+bwd": fwd_bwd(
                lambda: (raggedfn.map(bert, x, trainable, in_dims=(0, None)).values ** 2).sum()
            ),
        },
        "hand-written": {
            "fwd": lambda: hand_written(x, params),
            "fwd+bwd": fwd_bwd(lambda: (hand_written(x, trainable).values ** 2).sum()),
        },
        "padded": {
            "fwd": lambda: torch.func.functional_call(
                layer, params, (padded,), {"src_key_padding_mask": key_padding}
            ),
            "fwd+bwd": fwd_bwd(padded_loss(None)),
        },
    }
    if not args.no_compile:

        def padded_fn(p: dict[str, torch.Tensor], inputs: torch.Tensor, pad: torch.Tensor) -> Any:
            return torch.func.functional_call(layer, p, (inputs,), {"src_key_padding_mask": pad})

        compiled = torch.compile(padded_fn)
        systems["padded compiled"] = {
            "fwd": lambda: compiled(params, padded, key_padding),
            "fwd+bwd": fwd_bwd(padded_loss(lambda a, m: compiled(trainable, a, m))),
        }

    # rounds: every system runs once per round, in an order rotated from round to round
    # and reversed every other round, so a change of load on the shared machine hits all
    # of them; ratios are medians of per-round ratios
    names = list(systems)
    times: dict[str, dict[str, list[float]]] = {n: {m: [] for m in systems[n]} for n in names}

    def once(run: Callable[[], Any], mode: str) -> float:
        start = time.perf_counter()
        if mode == "fwd":
            with torch.no_grad():
                run()
        else:
            run()
        return 1000 * (time.perf_counter() - start)

    for mode in ("fwd", "fwd+bwd"):
        for _ in range(2):  # warm-up
            for name in names:
                once(systems[name][mode], mode)
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order[::-1] if r % 2 else order:
                times[name][mode].append(once(systems[name][mode], mode))

    def ratio(name: str, ref: str, mode: str) -> float:
        pairs = zip(times[name][mode], times[ref][mode], strict=True)
        return statistics.median(a / b for a, b in pairs)

    lookup_us, check_us = lookup_cost(bert, x, params)
    modes = ("fwd", "fwd+bwd")
    return {
        **header("map_bert", args),
        "batch": args.batch,
        "lengths": lengths,
        "occupancy": total / (len(lengths) * longest),
        "d_model": D_MODEL,
        "heads": HEADS,
        "feed_forward": FF,
        "rounds": args.repeats,
        "first_call_s": first_call,
        "second_trace_s": second_trace,
        "lookup_us": lookup_us,
        "check_us": check_us,
        "median_ms": {n: {m: statistics.median(times[n][m]) for m in modes} for n in names},
        "over": {
            ref: {n: {m: ratio(n, ref, m) for m in modes} for n in names}
            for ref in ("hand-written", "padded")
        },
    }


def markdown(record: dict[str, Any]) -> str:
    lengths = record["lengths"]
    lines = [
        f"B = {record['batch']}, lengths lognormal mean {sum(lengths) / len(lengths):.0f} "
        f"max {max(lengths)}, d_model {record['d_model']}, threads {record['threads']}, "
        f"occupancy {record['occupancy']:.3f}, median of {record['rounds']} rounds",
        "",
        f"map: first call (trace + run) {record['first_call_s']:.2f} s; "
        f"trace of a second signature {record['second_trace_s']:.2f} s; "
        f"per warm call: cache lookup {record['lookup_us']:.0f} us, of which the check of "
        f"what f reads (guards + lifted tensors) {record['check_us']:.0f} us",
        "",
        "| system | fwd ms | fwd+bwd ms | fwd vs hand-written | fwd+bwd vs hand-written "
        "| fwd vs padded eager | fwd+bwd vs padded eager |",
        "|---|---|---|---|---|---|---|",
    ]
    hand, padded = record["over"]["hand-written"], record["over"]["padded"]
    for name, ms in record["median_ms"].items():
        lines.append(
            f"| {name} | {ms['fwd']:.1f} | {ms['fwd+bwd']:.1f} "
            f"| {hand[name]['fwd']:.2f} | {hand[name]['fwd+bwd']:.2f} "
            f"| {padded[name]['fwd']:.2f} | {padded[name]['fwd+bwd']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lengths / 4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true")
    return cli(parser, run, markdown, argv, plot=plots.plot_map_bert)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
