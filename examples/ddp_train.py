"""Data-parallel training on ragged batches: token budgets, collate, DDP, ``raggedfn.map``.

Run on 2 CPU processes (gloo) or, with CUDA, one process per GPU (NCCL)::

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --samples 256 --epochs 2

The data path: a dataset of variable-length token sequences -> a
``TokenBudgetBatchSampler`` (about ``--max-tokens`` tokens per batch, the same
number of batches on every rank) -> ``raggedfn.data.collate`` in worker
processes (a ``Ragged`` batch, no padding) -> pinned memory and a non-blocking
copy when a GPU is used -> a model whose ``forward`` runs a per-sample function
over the batch with ``raggedfn.map``, wrapped in ``DistributedDataParallel``.

The task is synthetic: a sequence is labelled 1 when more than half of its tokens
come from the lower half of the vocabulary. The loss is the mean over the
samples of *all* ranks (each rank divides its sum by the global sample count and
DDP averages over ranks), so the gradients equal one process training on the
union of the ranks' batches.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

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
        low_share = torch.rand((), generator=gen)  # share of lower-half tokens
        n = int(self.lengths[i])
        low = torch.rand(n, generator=gen) < low_share
        tokens = torch.where(
            low,
            torch.randint(0, VOCAB // 2, (n,), generator=gen),
            torch.randint(VOCAB // 2, VOCAB, (n,), generator=gen),
        )
        return {"tokens": tokens, "label": int(low.float().mean() > 0.5)}


class Classifier(torch.nn.Module):
    """Embed tokens, a per-token MLP, mean over the sequence, two logits per sample."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 2)

    def forward(self, tokens: raggedfn.Ragged) -> torch.Tensor:
        # token-wise layers act on the packed values directly
        embedded = tokens.with_values(self.embed(tokens.values))

        def per_sample(x: torch.Tensor) -> torch.Tensor:  # x: [N, width], one sequence
            return self.head(torch.tanh(self.hidden(x)).mean(0))

        return raggedfn.map(per_sample, embedded)  # [B, 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--mean-length", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    else:  # plain `python examples/ddp_train.py`: a group of one
        store = os.path.join(tempfile.mkdtemp(), "rendezvous")
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also syncs)

    dataset = Sequences(args.samples, args.mean_length, args.seed)
    sampler = TokenBudgetBatchSampler(dataset.lengths, args.max_tokens, seed=args.seed)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        # declared ragged: a batch of one sequence is a Ragged too
        collate_fn=functools.partial(collate, ragged={"tokens"}),
        num_workers=args.workers,
        pin_memory=cuda,  # the pin-memory thread pins the Ragged's three tensors
        persistent_workers=args.workers > 0,
    )
    model = Classifier().to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        totals = torch.zeros(3, device=device)  # loss sum, correct, samples (this rank)
        bar = tqdm(loader, desc=f"epoch {epoch}", disable=rank != 0, unit="batch")
        for batch in bar:
            tokens = batch["tokens"].to(device, non_blocking=True)
            labels = batch["label"].to(device, non_blocking=True)
            count = torch.tensor(float(len(labels)), device=device)
            dist.all_reduce(count)  # samples in this step on all ranks together
            logits = ddp(tokens)
            loss_sum = F.cross_entropy(logits, labels, reduction="sum")
            optimizer.zero_grad()
            (loss_sum * world / count).backward()  # DDP averages: the mean over all ranks
            optimizer.step()
            correct = (logits.argmax(1) == labels).sum()
            totals += torch.stack([loss_sum.detach(), correct, torch.tensor(len(labels))])
            bar.set_postfix(loss=f"{float(loss_sum.detach()) / max(len(labels), 1):.4f}")
        dist.all_reduce(totals)
        loss, correct, seen = totals.tolist()
        if rank == 0:
            print(
                f"epoch {epoch}: loss {loss / seen:.4f} accuracy {correct / seen:.3f} "
                f"({len(sampler)} steps per rank, {world} ranks)",
                flush=True,
            )
    # Free DDP while the group is still registered: in torch 2.13 a gloo group whose last
    # owner is DDP's reducer is destroyed without releasing the GIL, which can deadlock
    # with gloo's worker threads at exit.
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
