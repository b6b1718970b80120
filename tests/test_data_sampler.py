"""TokenBudgetBatchSampler: its invariants over many seeds, epochs, budgets and replicas."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggedfn import RaggedError
from raggedfn.data import TokenBudgetBatchSampler

SETTINGS = settings(deadline=None, max_examples=150)


def every_rank(lengths, max_tokens, num_replicas, **kwargs) -> list[list[list[int]]]:
    out = []
    for rank in range(num_replicas):
        sampler = TokenBudgetBatchSampler(
            lengths, max_tokens, num_replicas=num_replicas, rank=rank, **kwargs
        )
        batches = list(sampler)
        assert len(sampler) == len(batches)
        assert all(isinstance(i, int) for b in batches for i in b)
        out.append(batches)
    return out


def lognormal(n: int, seed: int, mean: float = 128, sigma: float = 1.0) -> np.ndarray:
    """Realistic lengths: lognormal with the given mean, clipped to [16, 512]."""
    rng = np.random.default_rng(seed)
    drawn = rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n)
    return np.clip(np.round(drawn), 16, 512).astype(np.int64)


@SETTINGS
@given(
    lengths=st.lists(st.integers(0, 300), max_size=120),
    max_tokens=st.integers(1, 700),
    num_replicas=st.integers(1, 4),
    seed=st.integers(-(2**40), 2**40),
    epoch=st.integers(0, 1000),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_invariants(lengths, max_tokens, num_replicas, seed, epoch, shuffle, drop_last) -> None:
    kwargs = {"seed": seed, "shuffle": shuffle, "drop_last": drop_last}
    per_rank = []
    for rank in range(num_replicas):
        sampler = TokenBudgetBatchSampler(
            lengths, max_tokens, num_replicas=num_replicas, rank=rank, **kwargs
        )
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(sampler) == len(batches)
        assert batches == list(sampler)  # iterating again gives the same epoch
        per_rank.append(batches)
    # the budget: only a sample longer than max_tokens goes over it, and it is alone
    for batch in (b for batches in per_rank for b in batches):
        assert batch, "empty batch"
        total = sum(lengths[i] for i in batch)
        assert total <= max_tokens or (len(batch) == 1 and lengths[batch[0]] > max_tokens)
    # DDP steps in lockstep: every rank has the same number of batches
    assert len({len(batches) for batches in per_rank}) == 1
    counts = Counter(i for batches in per_rank for b in batches for i in b)
    single = TokenBudgetBatchSampler(lengths, max_tokens, num_replicas=1, rank=0, **kwargs)
    single.set_epoch(epoch)
    single_batches = list(single)
    if num_replicas == 1:
        assert sorted(counts) == list(range(len(lengths))) and set(counts.values()) <= {1}
    elif drop_last:
        # each index at most once; fewer than num_replicas whole batches dropped
        assert set(counts.values()) <= {1}
        kept = sorted(sorted(b) for batches in per_rank for b in batches)
        assert len(kept) == len(single_batches) - len(single_batches) % num_replicas
        assert Counter(map(tuple, kept)) <= Counter(tuple(sorted(b)) for b in single_batches)
    else:
        # every index covered; repeats only to pad single-sample batches, fewer than the ranks
        assert sorted(counts) == list(range(len(lengths)))
        repeats = sum(c - 1 for c in counts.values())
        assert repeats < num_replicas
        if repeats:
            assert all(len(b) == 1 for batches in per_rank for b in batches)


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 100),
    max_tokens=st.sampled_from([1024, 2048, 4096, 8192]),
    num_replicas=st.integers(1, 8),
    sigma=st.sampled_from([0.45, 1.0]),
)
def test_fill_and_balance_on_realistic_lengths(
    seed, epoch, max_tokens, num_replicas, sigma
) -> None:
    lengths = lognormal(20_000, seed, sigma=sigma)
    per_rank = []
    for rank in range(num_replicas):
        sampler = TokenBudgetBatchSampler(
            lengths, max_tokens, seed=seed, num_replicas=num_replicas, rank=rank
        )
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    totals = [[int(lengths[b].sum()) for b in batches] for batches in per_rank]
    fills = np.array([t for rank_totals in totals for t in rank_totals]) / max_tokens
    # batches at least 90% full: on average, and all but the epoch's last batch and the
    # halves of the (fewer than num_replicas) batches split to give the ranks equal counts
    assert fills.mean() >= 0.9
    assert (fills < 0.9).sum() <= 2 * (num_replicas - 1) + 1
    # ranks' token totals within 10% of each other
    rank_tokens = [sum(t) for t in totals]
    assert (max(rank_tokens) - min(rank_tokens)) / max(rank_tokens) <= 0.1


def test_deterministic_for_seed_and_epoch() -> None:
    lengths = lognormal(2000, 0)

    def epoch_batches(seed: int, epoch: int, rank: int = 0) -> list[list[int]]:
        sampler = TokenBudgetBatchSampler(lengths, 1024, seed=seed, num_replicas=2, rank=rank)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert epoch_batches(3, 5) == epoch_batches(3, 5)
    assert epoch_batches(3, 5) != epoch_batches(3, 6)
    assert epoch_batches(3, 5) != epoch_batches(4, 5)
    assert epoch_batches(3, 5) != epoch_batches(3, 5, rank=1)
    # a new epoch draws new batches, not only a new order of the same batches
    before = {tuple(sorted(b)) for b in epoch_batches(3, 5)}
    after = {tuple(sorted(b)) for b in epoch_batches(3, 6)}
    assert len(before & after) < len(before) / 2


def test_no_shuffle_is_the_same_every_epoch() -> None:
    lengths = lognormal(500, 1)
    sampler = TokenBudgetBatchSampler(lengths, 1024, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) == first
    totals = [int(lengths[b].sum()) for b in first]
    assert totals == sorted(totals, reverse=True)


def test_accepts_tensors_and_numpy_lengths() -> None:
    lengths = [5, 3, 8, 2, 7, 1]
    expected = list(TokenBudgetBatchSampler(lengths, 10))
    assert list(TokenBudgetBatchSampler(torch.tensor(lengths), 10)) == expected
    assert list(TokenBudgetBatchSampler(np.array(lengths, dtype=np.int32), 10)) == expected
    assert list(TokenBudgetBatchSampler([], 10)) == []


def test_without_a_process_group_one_replica() -> None:
    sampler = TokenBudgetBatchSampler([1, 2, 3], 4)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "kwargs", "message"),
    [
        ([1, -2], 4, {}, r"lengths must be non-negative, got lengths\[1\] = -2"),
        ([1.5, 2], 4, {}, "lengths must be a 1-D sequence of ints"),
        ([[1, 2]], 4, {}, "lengths must be a 1-D sequence of ints"),
        ([1, 2], 0, {}, "max_tokens must be a positive int"),
        ([1, 2], 2.5, {}, "max_tokens must be a positive int"),
        ([1, 2], 4, {"num_replicas": 2, "rank": 2}, r"rank must be an int in \[0, 2\)"),
        ([1, 2], 4, {"num_replicas": 0, "rank": 0}, "num_replicas must be a positive int"),
        ([1, 2], 4, {"num_replicas": 2}, "num_replicas is given but rank is not"),
        ([1, 2], 4, {"rank": 1}, "rank is given but num_replicas is not"),
        ([1, 2], 4, {"seed": "a"}, "seed must be an int"),
    ],
)
def test_bad_arguments(lengths, max_tokens, kwargs, message) -> None:
    with pytest.raises(RaggedError, match=f"TokenBudgetBatchSampler: {message}"):
        TokenBudgetBatchSampler(lengths, max_tokens, **kwargs)


def test_set_epoch_needs_an_int() -> None:
    with pytest.raises(RaggedError, match="set_epoch: epoch must be an int"):
        TokenBudgetBatchSampler([1], 2).set_epoch(1.5)  # type: ignore[arg-type]


def test_is_a_batch_sampler_for_dataloader() -> None:
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    data = [torch.full((n,), float(i)) for i, n in enumerate(lengths)]
    sampler = TokenBudgetBatchSampler(lengths, 10, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=list)
    assert len(loader) == len(sampler)
    got = [[int(t[0]) for t in batch] for batch in loader]
    assert got == list(sampler)


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_balance_tokens_when_batches_differ(shuffle) -> None:
    # every sample is over the budget, so each is a batch of its own and the batches
    # differ a lot; dealing them in turn would give rank 0 280 tokens and rank 1 240
    lengths = [100, 90, 80, 70, 60, 50, 40, 30]
    totals = [
        sum(lengths[i] for b in batches for i in b)
        for batches in every_rank(lengths, 10, 2, shuffle=shuffle, seed=4)
    ]
    assert max(totals) - min(totals) <= 10
