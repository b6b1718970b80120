"""The main demo (``make demo``): a per-sample transformer trained on ragged batches.

The task: a sequence of digits (odd lengths 5..65) is labelled 1 when it holds more
odd than even digits, so the model has to look at the whole sequence. The model
is written for ONE sample (``model`` below: ordinary torch code on a ``[N]``
tensor of token ids), mapped over the packed batch with ``raggedfn.map``,
differentiated with ``torch.func.grad_and_value`` and compiled with
``torch.compile``. Afterwards the same training step runs on padded tensors
with a key mask, side by side, to show what padding costs.

Run ``python examples/demo.py --help`` for the knobs; ``--steps 20 --no-compile``
is the quick smoke run the tests use.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

import raggedfn

DIM, HEADS, VOCAB = 32, 4, 10
Params = dict[str, Tensor]

# torch 2.13's dynamo instantiates torch.autograd.Function() for the ctx of each custom
# Function it traces (raggedfn's segment primitives) and warns about it; harmless.
warnings.filterwarnings(
    "ignore", message=".*should not be instantiated", category=DeprecationWarning
)


def init_params(seed: int = 0, dim: int = DIM) -> Params:
    gen = torch.Generator().manual_seed(seed)

    def dense(rows: int, cols: int) -> Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    return {
        "embed": torch.randn(VOCAB, dim, generator=gen),
        "wq": dense(dim, dim),
        "wk": dense(dim, dim),
        "wv": dense(dim, dim),
        "wo": dense(dim, dim),
        "w1": dense(2 * dim, dim),
        "b1": torch.zeros(2 * dim),
        "w2": dense(dim, 2 * dim),
        "b2": torch.zeros(dim),
        "wc": dense(2, dim),
        "bc": torch.zeros(2),
    }


def model(tokens: Tensor, p: Params) -> Tensor:
    """One sample: ``tokens [N]`` int64 -> logits ``[2]``. Plain torch, no raggedfn."""
    dim = p["wq"].shape[0]
    h = F.embedding(tokens, p["embed"])  # [N, D]
    q = (h @ p["wq"]).view(-1, HEADS, dim // HEADS).transpose(0, 1)  # [H, N, Dh]
    k = (h @ p["wk"]).view(-1, HEADS, dim // HEADS).transpose(0, 1)
    v = (h @ p["wv"]).view(-1, HEADS, dim // HEADS).transpose(0, 1)
    a = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(-1, dim)
    h = F.layer_norm(h + a @ p["wo"], (dim,))
    h = h + F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])
    return F.linear(h.mean(0), p["wc"], p["bc"])


def ragged_loss(p: Params, tokens: raggedfn.Ragged, labels: Tensor) -> Tensor:
    logits = raggedfn.map(model, tokens, p, in_dims=(0, None))  # [B, 2]
    return F.cross_entropy(logits, labels)


def padded_loss(p: Params, tokens: Tensor, keep: Tensor, labels: Tensor) -> Tensor:
    """The same model on ``[B, L]`` padded tokens with a ``[B, L]`` key mask."""
    batch, length = tokens.shape
    dim = p["wq"].shape[0]
    h = F.embedding(tokens, p["embed"])  # [B, L, D]

    def heads(w: Tensor) -> Tensor:
        return (h @ w).view(batch, length, HEADS, dim // HEADS).transpose(1, 2)

    attn_mask = keep[:, None, None, :]  # keys only; padded queries are dropped below
    a = F.scaled_dot_product_attention(
        heads(p["wq"]), heads(p["wk"]), heads(p["wv"]), attn_mask=attn_mask
    )
    a = a.transpose(1, 2).reshape(batch, length, dim)
    h = F.layer_norm(h + a @ p["wo"], (dim,))
    h = h + F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])
    weights = keep.to(h.dtype).unsqueeze(-1)
    pooled = (h * weights).sum(1) / weights.sum(1)
    return F.cross_entropy(F.linear(pooled, p["wc"], p["bc"]), labels)


def make_batch(gen: torch.Generator, batch: int, max_len: int) -> tuple[raggedfn.Ragged, Tensor]:
    """Digits with odd lognormal lengths in [5, max_len + 1]; label 1 = more odd than even digits."""
    raw = torch.exp(torch.randn(batch, generator=gen) * 0.6 + math.log(max_len / 3))
    # odd lengths: no ties, so both labels are equally likely and chance is 0.5
    lengths = (raw.round().clamp(4, max_len).to(torch.int64) // 2) * 2 + 1
    digits = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=gen)
    tokens = raggedfn.from_lengths(digits, lengths)
    odd = raggedfn.sum(raggedfn.apply(torch.remainder, tokens, 2), 1)
    labels = (2 * odd > lengths).to(torch.int64)
    return tokens, labels


def train(args: argparse.Namespace) -> float:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    params = init_params(args.seed)
    leaves = [t.requires_grad_() for t in params.values()]
    optimizer = torch.optim.Adam(leaves, lr=args.lr)
    step = torch.func.grad_and_value(ragged_loss)
    if args.compile:
        eager_step = step
        step = torch.compile(step, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    print(
        f"training: {args.steps} steps, batch {args.batch}, odd lengths 5..{args.max_len + 1}, "
        f"{'compiled' if args.compile else 'eager'} raggedfn.map + torch.func.grad_and_value"
    )
    losses: list[float] = []
    bar = tqdm(range(1, args.steps + 1), desc="  training", unit="step", dynamic_ncols=True)
    for i in bar:
        tokens, labels = make_batch(gen, args.batch, args.max_len)
        detached = {k: v.detach() for k, v in params.items()}
        if args.compile and i == 1:
            eager_step(detached, tokens, labels)  # raggedfn.map traces f eagerly once per signature
        raggedfn.mark_dynamic(tokens)
        grads, loss = step(detached, tokens, labels)
        for name, tensor in params.items():
            tensor.grad = grads[name]
        optimizer.step()
        losses.append(float(loss))
        if i % 10 == 0 or i == args.steps:
            accuracy = evaluate(params, gen, args, 64)
            bar.set_postfix(loss=f"{statistics.fmean(losses[-10:]):.3f}", acc=f"{accuracy:.2f}")
    bar.close()
    if args.compile:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(f"compiled graphs over {args.steps} batches of new lengths: {graphs}")
    accuracy = evaluate(params, gen, args, 512)
    print(
        f"loss {statistics.fmean(losses[:10]):.3f} -> {statistics.fmean(losses[-10:]):.3f}; "
        f"held-out accuracy {accuracy:.3f} (chance 0.5)"
    )
    return accuracy


@torch.no_grad()
def evaluate(params: Params, gen: torch.Generator, args: argparse.Namespace, count: int) -> float:
    tokens, labels = make_batch(gen, count, args.max_len)
    detached = {k: v.detach() for k, v in params.items()}
    logits = raggedfn.map(model, tokens, detached, in_dims=(0, None))
    return float((logits.argmax(1) == labels).float().mean())


def _padded_inputs(tokens: raggedfn.Ragged) -> tuple[Tensor, Tensor]:
    return raggedfn.to_padded(tokens), raggedfn.mask(tokens)


def _median_time(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _steps(system: str, batch: int, max_len: int, dim: int) -> Any:
    gen = torch.Generator().manual_seed(123)
    params = init_params(1, dim)
    tokens, labels = make_batch(gen, batch, max_len)
    if system == "raggedfn":
        step = torch.func.grad_and_value(ragged_loss)
        return lambda: step(params, tokens, labels), tokens
    padded, keep = _padded_inputs(tokens)
    padded_step = torch.func.grad_and_value(padded_loss)
    return lambda: padded_step(params, padded, keep, labels), tokens


def _peak_rss_mib(system: str, batch: int, max_len: int, dim: int) -> float | None:
    """Growth of the peak RSS over the resident set while running a step, in a fresh process."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import json, demo as d\n"
        f"run, _ = d._steps({system!r}, {batch}, {max_len}, {dim}); run()\n"
        "import gc; gc.collect()\n"
        "before = d._status_kib('VmRSS:')\n"
        "with open('/proc/self/clear_refs', 'w') as f: f.write('5')\n"
        "for _ in range(3): run()\n"
        "print(json.dumps(d._status_kib('VmHWM:') - before))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
        )
        return float(json.loads(out.stdout.strip().splitlines()[-1])) / 1024
    except Exception:
        return None


def _status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM is the peak RSS since clear_refs)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def compare(args: argparse.Namespace) -> None:
    """Time one eager training step, raggedfn vs padded, in this process."""
    torch.set_num_threads(args.threads)
    size = (args.batch, args.compare_max_len, args.compare_dim)
    ragged_run, tokens = _steps("raggedfn", *size)
    padded_run, _ = _steps("padded", *size)
    # alternate the two so drift of a shared machine hits both
    ragged_times, padded_times = [], []
    ragged_run()
    padded_run()
    for _ in range(args.repeats):
        ragged_times.append(_median_time(ragged_run, 1))
        padded_times.append(_median_time(padded_run, 1))
    lengths = tokens.lengths.to(torch.float64)
    longest = float(lengths.max())
    ideal_tokens = float(lengths.sum()) / (len(lengths) * longest)
    ideal_pairs = float((lengths**2).sum()) / (len(lengths) * longest**2)
    t_ragged, t_padded = statistics.median(ragged_times), statistics.median(padded_times)
    mem_ragged = _peak_rss_mib("raggedfn", *size)
    mem_padded = _peak_rss_mib("padded", *size)

    def mib(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f} MiB"

    print(
        f"\none eager training step (forward + backward) of the same model at d_model "
        f"{args.compare_dim}, batch {args.batch}, odd lengths 5..{args.compare_max_len + 1}, "
        f"{args.threads} threads, median of {args.repeats}:"
    )
    print(
        f"  occupancy: {ideal_tokens:.2f} of padded tokens, {ideal_pairs:.2f} of padded attention pairs"
    )
    print(f"  {'system':<10} {'time/step':>10} {'speedup':>8} {'ideal':>12} {'peak memory':>12}")
    print(f"  {'padded':<10} {t_padded * 1e3:8.1f}ms {1.0:7.2f}x {'':>12} {mib(mem_padded):>12}")
    ideal = f"{1 / ideal_tokens:.1f}-{1 / ideal_pairs:.1f}x"
    print(
        f"  {'raggedfn':<10} {t_ragged * 1e3:8.1f}ms {t_padded / t_ragged:7.2f}x {ideal:>12} {mib(mem_ragged):>12}"
    )
    print("  (ideal: padded/real elements for the token-wise and the attention parts)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compare-dim", type=int, default=128, help="d_model of the timed step")
    parser.add_argument("--compare-max-len", type=int, default=256)
    parser.add_argument("--min-accuracy", type=float, default=0.8)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(args.threads)
    accuracy = train(args)
    if args.compare:
        compare(args)
    if accuracy < args.min_accuracy:
        print(f"FAILED: accuracy {accuracy:.3f} is below {args.min_accuracy} (chance is 0.5)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
