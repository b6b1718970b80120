"""Forward-mode vs reverse-mode AD cost on one ragged model (issue #14).

The model: B samples of ``[N_i, D]`` tokens (lengths uniform in ``[0, 2 * mean]``),
one attention block and a pooled read-out,

    h = layer_norm(x @ W1)                          # [N_i, D]
    a = attention(h, h, h) over H heads, causal     # [N_i, D]
    y = (sum_n softmax_n(a) * a + logsumexp_n(h)) @ W2   # [D]

differentiated with respect to ``W1`` (``D x D``). Each transform runs on two systems,
checked against each other first:

- ``raggedfn``: the public ops on a packed ``Ragged`` (``linear``, ``layer_norm``,
  ``attention``, ``softmax``, ``sum``, ``logsumexp``);
- ``loop``: the same per sample with torch ops (what the per-sample loop's transforms
  cost). Its ``jvp`` and both Hessian-vector products run SDPA on torch's math
  backend: the fused CPU kernel has no forward-mode derivative (raggedfn takes the
  math backend itself under forward mode) and no double backward.

Transforms, each with a fixed tangent/cotangent:

- ``forward``: the model alone (no autograd);
- ``vjp``: ``torch.func.vjp`` and one cotangent (reverse mode, one backward);
- ``jvp``: ``torch.func.jvp`` with one tangent (forward mode);
- ``hvp fwd-over-rev``: ``jvp(grad(loss))`` (a Hessian-vector product, forward over
  reverse, the pattern ``torch.func.hessian`` uses);
- ``hvp rev-over-rev``: ``vjp(grad(loss))`` (the same product, reverse over reverse),
  inside ``sdpa_kernel(SDPBackend.MATH)`` for both systems: a double backward through
  torch's fused CPU SDPA kernel raises, and eager ``raggedfn.attention`` calls that
  kernel unless a forward-mode tangent is present.

Each round runs every (system, transform) cell once in a rotating order; every
ratio is the median of per-round ratios. Run: ``python -m benchmarks.forward_mode
[--batch 32] [--mean 48] [--dim 64] [--heads 4] [--rounds 15] [--threads 1]
[--json PATH] [--markdown PATH]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad, jvp, vjp
from torch.nn.attention import SDPBackend, sdpa_kernel

import raggedfn
from benchmarks import plots
from benchmarks._standalone import cli, header, timed

TRANSFORMS = ["forward", "vjp", "jvp", "hvp fwd-over-rev", "hvp rev-over-rev"]
SYSTEMS = ["raggedfn", "loop"]
# the loop runs these on torch's math SDPA: the fused CPU kernel has neither a
# forward-mode derivative nor a double backward
MATH_SDPA = {"jvp", "hvp fwd-over-rev", "hvp rev-over-rev"}


class Inputs:
    """The data of one run, identical for both systems (fixed seed)."""

    def __init__(self, batch: int, mean: int, dim: int, heads: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(0, 2 * mean + 1, (batch,), generator=gen).tolist()
        self.dim, self.heads = dim, heads
        total = sum(self.lengths)
        self.values = torch.randn(total, dim, generator=gen)
        self.w1 = torch.randn(dim, dim, generator=gen) / math.sqrt(dim)
        self.w2 = torch.randn(dim, dim, generator=gen) / math.sqrt(dim)
        self.tangent = torch.randn(dim, dim, generator=gen)
        self.cotangent = torch.randn(batch, dim, generator=gen)
        self.x = raggedfn.from_lengths(self.values, self.lengths)


def ragged_model(inputs: Inputs) -> Callable[[Tensor], Tensor]:
    d, heads = inputs.dim, inputs.heads

    def model(w1: Tensor) -> Tensor:
        h = raggedfn.layer_norm(raggedfn.linear(inputs.x, w1), d)
        q = raggedfn.unflatten(h, 2, (heads, d // heads))  # (B, N*, H, Dh)
        a = raggedfn.flatten(raggedfn.attention(q, q, q, causal=True), 2, 3)
        pooled = raggedfn.sum(raggedfn.softmax(a, 1) * a, 1)
        lse = raggedfn.logsumexp(h, 1)
        pooled = pooled + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return pooled @ inputs.w2

    return model


def loop_model(inputs: Inputs) -> Callable[[Tensor], Tensor]:
    d, heads = inputs.dim, inputs.heads
    samples = list(inputs.values.split(inputs.lengths))

    def model(w1: Tensor) -> Tensor:
        rows = []
        for t in samples:
            h = F.layer_norm(t @ w1.T, (d,))
            q = h.unflatten(1, (heads, d // heads)).transpose(0, 1)  # [H, N, Dh]
            a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            a = a.transpose(0, 1).flatten(1)
            pooled = (a.softmax(0) * a).sum(0)
            if t.shape[0]:  # logsumexp of an empty sample is -inf: 0 here as above
                pooled = pooled + h.logsumexp(0)
            rows.append(pooled)
        return torch.stack(rows) @ inputs.w2

    return model


def transform(name: str, model: Callable[[Tensor], Tensor], inputs: Inputs) -> Callable[[], Any]:
    """A no-argument call running ``name`` of ``model`` at ``inputs.w1``."""
    w1, tangent, cotangent = inputs.w1, inputs.tangent, inputs.cotangent

    def loss(w: Tensor) -> Tensor:
        return (model(w) * cotangent).sum()

    calls: dict[str, Callable[[], Any]] = {
        "forward": lambda: model(w1),
        "vjp": lambda: vjp(model, w1)[1](cotangent)[0],
        "jvp": lambda: jvp(model, (w1,), (tangent,))[1],
        "hvp fwd-over-rev": lambda: jvp(grad(loss), (w1,), (tangent,))[1],
        "hvp rev-over-rev": lambda: vjp(grad(loss), w1)[1](tangent)[0],
    }
    return calls[name]


def cells(inputs: Inputs) -> dict[tuple[str, str], Callable[[], Any]]:
    models = {"raggedfn": ragged_model(inputs), "loop": loop_model(inputs)}
    out: dict[tuple[str, str], Callable[[], Any]] = {}
    for system, model in models.items():
        for name in TRANSFORMS:
            call = transform(name, model, inputs)
            if (system == "loop" and name in MATH_SDPA) or name == "hvp rev-over-rev":
                call = _on_math_sdpa(call)
            out[system, name] = call
    return out


def _on_math_sdpa(call: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with sdpa_kernel(SDPBackend.MATH):
            return call()

    return run


def check(table: dict[tuple[str, str], Callable[[], Any]]) -> None:
    """Both systems agree, and both Hessian-vector products agree: never time a wrong
    computation."""
    for name in TRANSFORMS:
        want = table["loop", name]()
        torch.testing.assert_close(table["raggedfn", name](), want, rtol=1e-4, atol=1e-4)
    for system in SYSTEMS:
        torch.testing.assert_close(
            table[system, "hvp fwd-over-rev"](),
            table[system, "hvp rev-over-rev"](),
            rtol=1e-4,
            atol=1e-4,
        )


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    inputs = Inputs(args.batch, args.mean, args.dim, args.heads)
    table = cells(inputs)
    check(table)
    keys = list(table)
    runs = {key: timed(call) for key, call in table.items()}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for r in range(args.rounds + 1):  # round 0 warms up
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            seconds = runs[key]()
            if r:
                times[key].append(seconds)
    record: dict[str, Any] = {
        **header("forward_mode", args),
        "lengths": inputs.lengths,
        "dim": args.dim,
        "heads": args.heads,
        "rounds": args.rounds,
        "median_ms": {s: {} for s in SYSTEMS},
        "over_vjp": {s: {} for s in SYSTEMS},
        "fwd_over_rev_hvp_over_rev_over_rev": {},
        "raggedfn_over_loop": {},
    }
    for system in SYSTEMS:
        for name in TRANSFORMS:
            record["median_ms"][system][name] = 1e3 * statistics.median(times[system, name])
            record["over_vjp"][system][name] = _median_ratio(
                times[system, name], times[system, "vjp"]
            )
        record["fwd_over_rev_hvp_over_rev_over_rev"][system] = _median_ratio(
            times[system, "hvp fwd-over-rev"], times[system, "hvp rev-over-rev"]
        )
    for name in TRANSFORMS:
        record["raggedfn_over_loop"][name] = _median_ratio(
            times["raggedfn", name], times["loop", name]
        )
    return record


def markdown(record: dict[str, Any]) -> str:
    lengths = record["lengths"]
    lines = [
        f"Attention block + pooled read-out, B = {len(lengths)} samples, {sum(lengths)} "
        f"tokens (lengths 0..{max(lengths)}, {lengths.count(0)} empty), D = {record['dim']}, "
        f"{record['heads']} heads, float32, derivative w.r.t. a D x D weight, "
        f"{record['threads']} thread(s), medians of {record['rounds']} rounds "
        f"(ratios: medians of per-round ratios)",
        "",
        "| transform | raggedfn ms | loop ms | raggedfn / its vjp | loop / its vjp "
        "| raggedfn / loop |",
        "|---|---|---|---|---|---|",
    ]
    ms, over = record["median_ms"], record["over_vjp"]
    for name in TRANSFORMS:
        lines.append(
            f"| {name} | {ms['raggedfn'][name]:.2f} | {ms['loop'][name]:.2f} | "
            f"{over['raggedfn'][name]:.2f} | {over['loop'][name]:.2f} | "
            f"{record['raggedfn_over_loop'][name]:.2f} |"
        )
    hvp = record["fwd_over_rev_hvp_over_rev_over_rev"]
    lines += [
        "",
        f"hvp forward-over-reverse / reverse-over-reverse: raggedfn {hvp['raggedfn']:.2f}, "
        f"loop {hvp['loop']:.2f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mean", type=int, default=48, help="mean sample length")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    return cli(parser, run, markdown, argv, plot=plots.plot_forward_mode)


if __name__ == "__main__":
    main(sys.argv[1:])
