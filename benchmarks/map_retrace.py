"""Training loops through ``raggedfn.map`` that rebind their parameters: no retracing.

Issue #21's measurement. A per-sample function captures its weights (a lambda
over ``W``, or a module's parameters through ``functional_call``); a functional
training loop rebinds them at every step (``W = W - lr * g``). Each loop runs
twice in one process, with the weights fixed and rebound, rounds alternating;
reported: median ms per step, the ratio rebound / fixed, and how many times
``map`` traced the function.

Usage: ``python -m benchmarks.map_retrace [--steps 600] [--bert-steps 60] [--rounds 10]
[--threads 1] [--json PATH [--markdown PATH]]``; with ``--json`` writes the record and
its plot (``benchmarks/results/map/``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import raggedfn
from benchmarks import plots
from benchmarks._standalone import cli, header
from raggedfn._map.caching import _cache


def _tokens(batch: int, dim: int, seed: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 41, (batch,), generator=gen)
    return raggedfn.from_lengths(torch.randn(int(lengths.sum()), dim, generator=gen), lengths)


class TanhLoop:
    """``map(lambda t: torch.tanh(t @ W).sum(0), x)`` with SGD on ``W``."""

    def __init__(self, rebind: bool, dim: int = 64) -> None:
        self.rebind = rebind
        self.x = _tokens(16, dim, 0)
        w = torch.randn(dim, dim, generator=torch.Generator().manual_seed(1)) / dim**0.5
        self.w = w.requires_grad_()
        self.f: Callable[..., torch.Tensor] | None = None

    def step(self) -> None:
        w = self.w
        self.f = f = lambda t: torch.tanh(t @ w).sum(0)
        loss = raggedfn.map(f, self.x).pow(2).mean()
        (grad,) = torch.autograd.grad(loss, (w,))
        with torch.no_grad():
            if self.rebind:
                self.w = (w - 0.01 * grad).requires_grad_()  # a new tensor every step
            else:
                w -= 0.01 * grad  # in place: the same tensor

    def traces(self) -> int:
        assert self.f is not None
        return raggedfn.map_cache_info(self.f).traces


class EncoderLoop:
    """A functional training loop of a small encoder layer: ``torch.func.grad`` of a
    loss that maps ``functional_call(layer, params, ...)`` over the batch; SGD
    rebinds ``params`` (or updates them in place)."""

    def __init__(self, rebind: bool) -> None:
        self.rebind = rebind
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.params = {k: v.detach().clone() for k, v in layer.named_parameters()}
        x = _tokens(16, 64, 2)

        def per_sample(t: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.functional_call(layer, p, (t[None],))[0].mean(0)

        def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            # the per-sample function captures p: a new dict of new tensors each step
            return raggedfn.map(lambda t: per_sample(t, p), x).pow(2).mean()

        self.grad = torch.func.grad(loss)
        self.lam = next(
            c for c in loss.__code__.co_consts if getattr(c, "co_name", "") == "<lambda>"
        )

    def step(self) -> None:
        grads = self.grad(self.params)
        if self.rebind:
            self.params = {k: v - 0.01 * grads[k] for k, v in self.params.items()}
        else:
            for k, v in self.params.items():
                v.sub_(0.01 * grads[k])

    def traces(self) -> int:
        entry = _cache.CACHE.get(self.lam)
        return 0 if entry is None else entry.traces


def measure(make: Callable[[bool], Any], steps: int, rounds: int = 10) -> dict[str, float]:
    """Fixed and rebound loops alternate in rounds of ``steps / rounds`` steps (the
    machine's load hits both), which goes first alternating from round to round; the
    ratio is the median of per-round ratios."""
    _cache.clear()
    loops = {"fixed": make(False), "rebound": make(True)}
    per_round = max(1, steps // rounds)
    times: dict[str, list[float]] = {"fixed": [], "rebound": []}
    for r in range(rounds + 1):
        for name in ("rebound", "fixed") if r % 2 else ("fixed", "rebound"):
            loop = loops[name]
            start = time.perf_counter()
            for _ in range(per_round):
                loop.step()
            if r:  # the first round warms up (and traces)
                times[name].append(1000 * (time.perf_counter() - start) / per_round)
    return {
        "fixed ms/step": statistics.median(times["fixed"]),
        "rebound ms/step": statistics.median(times["rebound"]),
        "ratio": statistics.median(
            b / a for a, b in zip(times["fixed"], times["rebound"], strict=True)
        ),
        # both loops run the same per-sample code: one cache entry counts their traces
        "traces": loops["rebound"].traces(),
        "steps": per_round * (rounds + 1),
    }


# row name -> (loop, the option giving its steps)
LOOPS: dict[str, tuple[Callable[[bool], Any], str]] = {
    "tanh(t @ W), B 16 of 1-40 rows, d 64": (TanhLoop, "steps"),
    "encoder layer d 64 (functional_call, torch.func.grad)": (EncoderLoop, "bert_steps"),
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    rows = {
        name: measure(make, getattr(args, steps), args.rounds)
        for name, (make, steps) in LOOPS.items()
    }
    return {**header("map_retrace", args), "rounds": args.rounds, "rows": rows}


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"{record['threads']} thread(s), median of {record['rounds']} rounds of both loops",
        "",
        "| loop | steps each | fixed ms/step | rebound ms/step | rebound / fixed "
        "| traces, both loops |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in record["rows"].items():
        lines.append(
            f"| {name} | {int(r['steps'])} | {r['fixed ms/step']:.2f} "
            f"| {r['rebound ms/step']:.2f} | {r['ratio']:.2f} | {int(r['traces'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--bert-steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=10)
    return cli(parser, run, markdown, argv, plot=plots.plot_map_retrace)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
