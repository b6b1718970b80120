"""``TokenBudgetBatchSampler``: batches by a budget of tokens, balanced over ranks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from .._errors import describe, fail

_FN = "TokenBudgetBatchSampler"

# samples are packed in pools of about this many batches' worth of tokens: large
# enough to fill batches tightly, small enough that a batch's samples are a random
# draw from the (shuffled) dataset rather than the same neighbours every epoch
POOL_BATCHES = 64
# a batch below this fill is repacked with the next pool's samples
FULL = 0.95


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices whose total length stays within ``max_tokens``.

    For ``DataLoader(dataset, batch_sampler=sampler, collate_fn=raggedfn.data.collate)``:
    the number of samples per batch varies, the number of tokens hardly does
    (fairseq's ``max_tokens``). Nothing is padded, so a batch's cost is its
    total length, not ``B * max length``.

    Each epoch (seeded by ``seed`` and :meth:`set_epoch`): the indices are
    shuffled, cut into pools of about 64 batches' worth of tokens, and each pool
    is packed longest-first, topping every batch up with the shortest samples
    left. A sample longer than ``max_tokens`` forms a batch of its own. With
    several replicas the batches are dealt so that every rank gets the same
    number of batches (DDP steps in lockstep) and about the same number of
    tokens: batches of similar size make up one step, and the largest batch of a
    step goes to the rank with the fewest tokens so far.

    Guarantees: every batch's total length is at most ``max_tokens`` (except a
    single sample longer than that); the batches are the same on every rank
    for a given ``(seed, epoch)`` and change with the epoch; with one replica
    every index appears exactly once per epoch. With ``num_replicas > 1``
    every rank yields the same number of batches; when the batches do not
    divide evenly, ``drop_last=False`` splits the largest batches in two
    (or, if every batch is a single sample, repeats some samples, as
    ``DistributedSampler`` pads) so that every index is still covered, and
    ``drop_last=True`` drops the least full batches instead (each index at
    most once). On realistic lengths (many samples per batch) batches are
    over 90% full and ranks' token totals agree within a few percent.

    Args:
        lengths: ``[N]`` non-negative length (tokens) of every sample.
        max_tokens: the budget of tokens per batch (>= 1).
        shuffle: draw a new order every epoch; ``False`` gives the same batches
            every epoch, largest first.
        seed: seed shared by all ranks.
        num_replicas: number of ranks; default the world size of the initialized
            default process group, else 1.
        rank: this rank; default the rank in the default process group, else 0.
        drop_last: with several replicas, drop batches instead of splitting
            (see above).

    Example:
        >>> import raggedfn
        >>> sampler = raggedfn.data.TokenBudgetBatchSampler([5, 3, 8, 2, 7, 1], max_tokens=10, seed=0)
        >>> batches = list(sampler)
        >>> sorted(i for b in batches for i in b), len(sampler) == len(batches)
        ([0, 1, 2, 3, 4, 5], True)
        >>> all(sum([5, 3, 8, 2, 7, 1][i] for i in b) <= 10 for b in batches)
        True
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.lengths = _as_lengths(lengths)
        if not _is_int(max_tokens) or max_tokens < 1:
            raise fail(_FN, f"max_tokens must be a positive int, got {describe(max_tokens)}")
        if not _is_int(seed):
            raise fail(_FN, f"seed must be an int, got {describe(seed)}")
        self.max_tokens = int(max_tokens)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.num_replicas, self.rank = _replicas(num_replicas, rank)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._planned: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (call before each epoch, as ``DistributedSampler``)."""
        if not _is_int(epoch):
            raise fail(f"{_FN}.set_epoch", f"epoch must be an int, got {describe(epoch)}")
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(b) for b in self._batches()])

    def __len__(self) -> int:
        return len(self._batches())

    def _batches(self) -> list[list[int]]:
        if self._planned is None or self._planned[0] != self.epoch:
            per_rank = plan_batches(
                self.lengths,
                self.max_tokens,
                seed=(self.seed, self.epoch) if self.shuffle else None,
                num_replicas=self.num_replicas,
                drop_last=self.drop_last,
            )
            self._planned = (self.epoch, per_rank[self.rank])
        return self._planned[1]


def plan_batches(
    lengths: np.ndarray,
    max_tokens: int,
    *,
    seed: tuple[int, int] | None,
    num_replicas: int = 1,
    drop_last: bool = False,
) -> list[list[list[int]]]:
    """Every rank's batches (lists of indices) for one epoch; ``seed=None``: no shuffling."""
    rng = None if seed is None else np.random.default_rng([s % 2**64 for s in seed])
    order = np.arange(len(lengths)) if rng is None else rng.permutation(len(lengths))
    batches = _pack(order, lengths, max_tokens)
    batches = _even_out(batches, lengths, num_replicas, drop_last)
    return _deal(batches, lengths, num_replicas, rng)


def _pack(order: np.ndarray, lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Pack the samples in ``order`` pool by pool. A pool's least full batches (below
    ``FULL``, at most ``POOL_BATCHES // 8``) go back into the next pool, so that only
    the last pool's can stay underfull."""
    if order.size == 0:
        return []
    ends = np.cumsum(lengths[order])
    cuts = np.searchsorted(
        ends, np.arange(POOL_BATCHES * max_tokens, int(ends[-1]), POOL_BATCHES * max_tokens)
    )
    pools = np.split(order, cuts)
    batches: list[list[int]] = []
    carry: list[int] = []
    for p, pool in enumerate(pools):
        packed = _pack_pool(carry + pool.tolist(), lengths, max_tokens)
        carry = []
        if p + 1 < len(pools):
            totals = [int(lengths[b].sum()) for b in packed]
            underfull = sorted((t, k) for k, t in enumerate(totals) if t < FULL * max_tokens)[
                : POOL_BATCHES // 8
            ]
            back = {k for _, k in underfull}
            carry = [i for k in sorted(back) for i in packed[k]]
            packed = [b for k, b in enumerate(packed) if k not in back]
        batches.extend(packed)
    return batches


def _pack_pool(pool: list[int], lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Longest samples first, each batch topped up with the shortest left."""
    pool_lengths = lengths[pool]
    by_length = np.argsort(-pool_lengths, kind="stable")  # ties keep the (random) pool order
    items = [pool[k] for k in by_length.tolist()]
    sizes = pool_lengths[by_length].tolist()
    batches = []
    i, j = 0, len(items) - 1
    while i <= j:
        if sizes[i] > max_tokens:  # too long for any batch: alone
            batches.append([items[i]])
            i += 1
            continue
        start, total = i, 0
        while i <= j and total + sizes[i] <= max_tokens:
            total += sizes[i]
            i += 1
        k = j
        while k >= i and total + sizes[k] <= max_tokens:
            total += sizes[k]
            k -= 1
        batches.append(items[start:i] + items[k + 1 : j + 1])
        j = k
    return batches


def _even_out(
    batches: list[list[int]], lengths: np.ndarray, num_replicas: int, drop_last: bool
) -> list[list[int]]:
    """Make the number of batches a multiple of ``num_replicas``."""
    missing = -len(batches) % num_replicas
    if missing == 0:
        return batches
    tokens = [int(lengths[b].sum()) for b in batches]
    if drop_last:
        surplus = num_replicas - missing
        drop = set(sorted(range(len(batches)), key=lambda b: (tokens[b], b))[:surplus])
        return [b for k, b in enumerate(batches) if k not in drop]
    batches = list(batches)
    for _ in range(missing):
        splittable = [k for k, b in enumerate(batches) if len(b) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda k: (len(batches[k]), k))
        batch = sorted(batches[k], key=lambda i: -int(lengths[i]))
        # alternate by length so that the halves carry similar numbers of tokens
        batches[k : k + 1] = [batch[0::2], batch[1::2]]
    missing = -len(batches) % num_replicas
    if missing:  # only single-sample batches, fewer than the ranks: repeat the shortest
        shortest = sorted(range(len(batches)), key=lambda k: (int(lengths[batches[k]].sum()), k))
        batches += [list(batches[shortest[m % len(shortest)]]) for m in range(missing)]
    return batches


def _deal(
    batches: list[list[int]],
    lengths: np.ndarray,
    num_replicas: int,
    rng: np.random.Generator | None,
) -> list[list[list[int]]]:
    """Deal the batches to ranks: steps of similar batches, tokens balanced."""
    tokens = [int(lengths[b].sum()) for b in batches]
    by_size = sorted(range(len(batches)), key=lambda k: (-tokens[k], k))
    steps = [by_size[s : s + num_replicas] for s in range(0, len(by_size), num_replicas)]
    if rng is not None:
        steps = [steps[s] for s in rng.permutation(len(steps)).tolist()]
    totals = [0] * num_replicas
    per_rank: list[list[list[int]]] = [[] for _ in range(num_replicas)]
    for step in steps:
        # the largest batch of the step goes to the rank with the fewest tokens so far
        ranks = sorted(range(num_replicas), key=lambda r: (totals[r], r))
        for k, r in zip(step, ranks, strict=True):
            per_rank[r].append(batches[k])
            totals[r] += tokens[k]
    return per_rank


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _as_lengths(lengths: Any) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        array = lengths.detach().cpu().numpy()
    else:
        try:
            array = np.asarray(lengths)
        except Exception as error:
            raise fail(
                _FN, f"lengths must be a 1-D sequence of ints, got {describe(lengths)}"
            ) from error
    if array.size == 0:
        array = array.astype(np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise fail(_FN, f"lengths must be a 1-D sequence of ints, got {describe(lengths)}")
    array = array.astype(np.int64)
    if array.size and int(array.min()) < 0:
        bad = int(np.argmin(array))
        raise fail(_FN, f"lengths must be non-negative, got lengths[{bad}] = {int(array[bad])}")
    return array


def _replicas(num_replicas: Any, rank: Any) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        if rank is not None and not initialized:
            raise fail(
                _FN, "rank is given but num_replicas is not (and no process group is initialized)"
            )
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        if num_replicas != 1 and not initialized:
            raise fail(
                _FN, "num_replicas is given but rank is not (and no process group is initialized)"
            )
        rank = dist.get_rank() if initialized else 0
    if not _is_int(num_replicas) or num_replicas < 1:
        raise fail(_FN, f"num_replicas must be a positive int, got {describe(num_replicas)}")
    if not _is_int(rank) or not 0 <= rank < num_replicas:
        raise fail(_FN, f"rank must be an int in [0, {num_replicas}), got {describe(rank)}")
    return int(num_replicas), int(rank)
