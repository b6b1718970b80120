"""A Pairformer block (AlphaFold 3's pair stack) written for one sample, run on a ragged batch.

A protein (or any set of ``N`` tokens) carries a pair state ``z [N, N, C]``; a
batch of them has a different ``N`` per sample, so padding costs ``B * N_max**2``
pair rows (``B * N_max**3`` in the triangle updates) where the real work is
``sum N_i**2`` (``sum N_i**3``). Here the block is ordinary torch code for ONE
pair state (``PairformerBlock`` below: triangle multiplicative updates outgoing
and incoming, triangle attention around the starting and the ending node, a
SwiGLU transition), and ``raggedfn.map`` runs it on a ``(B, N*, N*, C)`` batch.

The script checks the batched result and its parameter gradients against the
per-sample loop, prints ``raggedfn.map_report`` (what ran batched, and any op that
still ran as a per-sample loop), and times both.

Run ``python examples/pairformer.py --help`` for the knobs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import raggedfn

# torch 2.13 warns when its own code instantiates the autograd.Function of a segment
# primitive under torch.func; harmless (the test suite filters it the same way)
warnings.filterwarnings(
    "ignore", message=".*should not be instantiated", category=DeprecationWarning
)


class TriangleMultiplication(nn.Module):
    """``z_ij += gate * Linear(LN(sum_k a_ik * b_jk))`` (outgoing) or ``a_ki * b_kj`` (incoming)."""

    def __init__(self, channels: int, outgoing: bool) -> None:
        super().__init__()
        self.equation = "ikc,jkc->ijc" if outgoing else "kic,kjc->ijc"
        self.norm_in, self.norm_out = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.project = nn.Linear(channels, 4 * channels)  # a, b and their gates
        self.gate, self.out = nn.Linear(channels, channels), nn.Linear(channels, channels)

    def forward(self, z: Tensor) -> Tensor:
        z = self.norm_in(z)
        a_gate, a, b_gate, b = self.project(z).chunk(4, dim=-1)
        x = torch.einsum(self.equation, torch.sigmoid(a_gate) * a, torch.sigmoid(b_gate) * b)
        return torch.sigmoid(self.gate(z)) * self.out(self.norm_out(x))


class TriangleAttention(nn.Module):
    """Each row ``i`` of ``z`` attends over its ``j`` with a pair bias ``b_jk`` per head.

    Around the ending node it does the same on the transposed pair state.
    """

    def __init__(self, channels: int, heads: int, starting: bool) -> None:
        super().__init__()
        self.heads, self.starting = heads, starting
        self.norm = nn.LayerNorm(channels)
        self.qkv = nn.Linear(channels, 3 * channels, bias=False)
        self.bias = nn.Linear(channels, heads, bias=False)
        self.gate, self.out = nn.Linear(channels, channels), nn.Linear(channels, channels)

    def forward(self, z: Tensor) -> Tensor:
        if not self.starting:
            z = z.transpose(0, 1)
        n, _, c = z.shape
        z = self.norm(z)
        # [N, N, 3, H, d] -> 3 x [N (rows i), H, N (j), d]
        q, k, v = self.qkv(z).unflatten(-1, (3, self.heads, c // self.heads)).permute(2, 0, 3, 1, 4)
        bias = self.bias(z).permute(2, 0, 1)  # [H, N, N]: the same for every row i
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        o = self.out(torch.sigmoid(self.gate(z)) * o.transpose(1, 2).reshape(n, n, c))
        return o if self.starting else o.transpose(0, 1)


class Transition(nn.Module):
    """SwiGLU MLP on every pair."""

    def __init__(self, channels: int, factor: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.up = nn.Linear(channels, 2 * factor * channels, bias=False)
        self.down = nn.Linear(factor * channels, channels, bias=False)

    def forward(self, z: Tensor) -> Tensor:
        a, b = self.up(self.norm(z)).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


class PairformerBlock(nn.Module):
    """The pair track of one Pairformer block: ``z [N, N, C] -> [N, N, C]``."""

    def __init__(self, channels: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.triangle_out = TriangleMultiplication(channels, outgoing=True)
        self.triangle_in = TriangleMultiplication(channels, outgoing=False)
        self.attention_start = TriangleAttention(channels, heads, starting=True)
        self.attention_end = TriangleAttention(channels, heads, starting=False)
        self.transition = Transition(channels)

    def forward(self, z: Tensor) -> Tensor:
        z = z + self.triangle_out(z)
        z = z + self.triangle_in(z)
        z = z + self.attention_start(z)
        z = z + self.attention_end(z)
        return z + self.transition(z)


def make_pairs(
    gen: torch.Generator, batch: int, min_len: int, max_len: int, channels: int
) -> raggedfn.Ragged:
    """Random pair states ``(B, N*, N*, C)`` with ``N`` uniform in ``[min_len, max_len]``."""
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen)
    values = torch.randn(int((lengths**2).sum()), channels, generator=gen)
    return raggedfn.from_sizes(values, torch.stack([lengths, lengths], dim=1))


def batched_step(block: PairformerBlock) -> Callable[..., Any]:
    """Loss and parameter gradients of the block on a whole batch, through ``raggedfn.map``."""

    def loss(params: dict[str, Tensor], pairs: raggedfn.Ragged, target: Tensor) -> Tensor:
        def one(z: Tensor, p: dict[str, Tensor]) -> Tensor:
            return torch.func.functional_call(block, p, (z,))

        out = raggedfn.map(one, pairs, params, in_dims=(0, None))
        return (out.values * target).sum()

    return torch.func.grad_and_value(loss)


def loop_step(block: PairformerBlock) -> Callable[..., Any]:
    """The same, one sample at a time (what ``raggedfn.map`` stands for)."""

    def loss(params: dict[str, Tensor], pairs: raggedfn.Ragged, target: Tensor) -> Tensor:
        outs = [torch.func.functional_call(block, params, (z,)) for z in raggedfn.unbind(pairs)]
        return (torch.cat([o.reshape(-1, o.shape[-1]) for o in outs]) * target).sum()

    return torch.func.grad_and_value(loss)


def report(block: PairformerBlock, pairs: raggedfn.Ragged) -> raggedfn.MapReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a per-sample fallback warns; the report lists it
        return raggedfn.map_report(block, pairs)


def check(block: PairformerBlock, pairs: raggedfn.Ragged) -> float:
    """Largest difference between map and the loop, in the output and in the gradients."""
    params = {k: v.detach() for k, v in block.named_parameters()}
    target = torch.randn(pairs.values.shape, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads, value = batched_step(block)(params, pairs, target)
    grads_loop, value_loop = loop_step(block)(params, pairs, target)
    worst = float((value - value_loop).abs() / value_loop.abs().clamp(min=1))
    for name in grads:
        scale = grads_loop[name].abs().max().clamp(min=1)
        worst = max(worst, float((grads[name] - grads_loop[name]).abs().max() / scale))
    return worst


def timings(block: PairformerBlock, pairs: raggedfn.Ragged, repeats: int) -> tuple[float, float]:
    """Median seconds of one forward+backward step, map and loop, alternated."""
    params = {k: v.detach() for k, v in block.named_parameters()}
    target = torch.randn(pairs.values.shape)
    steps = {"map": batched_step(block), "loop": loop_step(block)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps.values():
            step(params, pairs, target)  # warm-up (and map's trace)
        for _ in tqdm(range(repeats), desc="  timing", unit="round", leave=False):
            for name, step in steps.items():
                start = time.perf_counter()
                step(params, pairs, target)
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["map"]), statistics.median(times["loop"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=48)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    block = PairformerBlock(args.channels, args.heads)
    pairs = make_pairs(gen, args.batch, args.min_len, args.max_len, args.channels)
    lengths = pairs.sizes[:, 0].to(torch.float64)
    print(
        f"Pairformer block, C = {args.channels}, {args.heads} heads, on {args.batch} pair states "
        f"N = {pairs.sizes[:, 0].tolist()}"
    )
    print(
        f"  real pairs / padded pairs: {float((lengths**2).sum() / (len(lengths) * lengths.max() ** 2)):.2f}"
        f", triangle work real / padded: {float((lengths**3).sum() / (len(lengths) * lengths.max() ** 3)):.2f}"
    )
    print(report(block, pairs))
    error = check(block, pairs)
    print(f"map vs per-sample loop, output and gradients: largest relative difference {error:.1e}")
    if error > args.tolerance:
        print(f"FAILED: the difference is above {args.tolerance}")
        return 1
    if args.repeats:
        t_map, t_loop = timings(block, pairs, args.repeats)
        print(
            f"forward+backward, median of {args.repeats}: map {t_map * 1e3:.0f} ms, "
            f"per-sample loop {t_loop * 1e3:.0f} ms ({t_loop / t_map:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
