"""FSDP2 training of a per-sample transformer: every block sharded, called inside ``raggedfn.map``.

Run on 2 CPU processes (gloo) or, with CUDA, one process per GPU (NCCL)::

    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py
    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py --layers 2 --epochs 2

Each sample is a variable-length token sequence; the model embeds the tokens (on
the packed values), runs ``--layers`` transformer encoder layers on each sequence
inside ``raggedfn.map`` (self-attention within the sequence, no padding, no mask)
and classifies the mean of the sequence. ``fully_shard`` is applied to every
layer, then to the whole model (the embedding and the head): each rank keeps
``1 / world`` of every parameter, gradient and optimizer state. ``map`` gathers
each layer's parameters once per call for the whole batch (FSDP2's own
all-gather, one per layer in the forward and one in the backward) and frees them
after it; FSDP2 reduce-scatters the gradients.

The task is synthetic: a sequence is labelled 1 when more than half of its tokens
come from the lower half of the vocabulary. The loss is the mean over the
samples of *all* ranks (each rank divides its sum by the global sample count and
FSDP averages over ranks), so training equals one process on the union batch.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import raggedfn
from raggedfn.data import TokenBudgetBatchSampler, collate

VOCAB = 64


class Sequences(torch.utils.data.Dataset):
    """``count`` random token sequences with lognormal lengths and a binary label."""

    def __init__(self, count: int, mean_length: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        sigma = 0.8
        drawn = rng.lognormal(math.log(mean_length) - sigma**2 / 2, sigma, count)
        self.lengths = np.clip(np.round(drawn), 2, 8 * mean_length).astype(np.int64)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        low_share = torch.rand((), generator=gen)
        n = int(self.lengths[i])
        low = torch.rand(n, generator=gen) < low_share
        tokens = torch.where(
            low,
            torch.randint(0, VOCAB // 2, (n,), generator=gen),
            torch.randint(VOCAB // 2, VOCAB, (n,), generator=gen),
        )
        return {"tokens": tokens, "label": int(low.float().mean() > 0.5)}


class Transformer(torch.nn.Module):
    """Token embedding, ``layers`` encoder layers per sequence, mean pooling, two logits."""

    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                width, heads, dim_feedforward=2 * width, dropout=0.0, norm_first=True
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(width, 2)

    def forward(self, tokens: raggedfn.Ragged) -> torch.Tensor:
        embedded = tokens.with_values(self.embed(tokens.values))  # token-wise: packed values
        layers = self.layers  # what f reaches: map gathers the sharded modules it finds

        def per_sample(x: torch.Tensor) -> torch.Tensor:  # x: [N, width], one sequence
            for layer in layers:
                x = layer(x)
            return x.mean(0)

        return self.head(raggedfn.map(per_sample, embedded))  # [B, 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--mean-length", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    else:  # plain `python examples/fsdp_train.py`: a group of one
        store = os.path.join(tempfile.mkdtemp(), "rendezvous")
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    train(args, device)
    # Free the model while the group is alive: map's traces keep the modules f called
    # (and, through FSDP2's state, the process group) until cleared, and FSDP2's modules
    # sit in reference cycles that only the garbage collector frees. Then every rank is
    # done with the group before any tears it down.
    raggedfn.map_cache_clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Shard the model over the group's ranks and train it; print the epochs on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    dataset = Sequences(args.samples, args.mean_length, args.seed)
    sampler = TokenBudgetBatchSampler(dataset.lengths, args.max_tokens, seed=args.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(collate, ragged={"tokens"}),
    )
    model = Transformer(args.width, args.layers, args.heads).to(device)
    full = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)  # every block its own unit
    fully_shard(model, mesh=mesh)  # the root: embedding and head
    held = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
    if rank == 0:
        print(f"parameters: {full} in all, {held} held by rank 0", flush=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        totals = torch.zeros(3, device=device)  # loss sum, correct, samples (this rank)
        for batch in loader:
            tokens = batch["tokens"].to(device)
            labels = batch["label"].to(device)
            count = torch.tensor(float(len(labels)), device=device)
            dist.all_reduce(count)  # samples in this step on all ranks together
            logits = model(tokens)
            loss_sum = F.cross_entropy(logits, labels, reduction="sum")
            optimizer.zero_grad()
            (loss_sum * world / count).backward()  # FSDP averages: the mean over all ranks
            optimizer.step()
            correct = (logits.argmax(1) == labels).sum()
            totals += torch.stack([loss_sum.detach(), correct, torch.tensor(len(labels))])
        dist.all_reduce(totals)
        loss, correct, seen = totals.tolist()
        if rank == 0:
            print(
                f"epoch {epoch}: loss {loss / seen:.4f} accuracy {correct / seen:.3f} "
                f"({len(sampler)} steps per rank, {world} ranks)",
                flush=True,
            )


if __name__ == "__main__":
    main()
