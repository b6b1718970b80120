"""raggedfn.data.collate: per leaf a Ragged, a stacked tensor or a tensor of numbers;
through a DataLoader with worker processes (fork and spawn)."""

from __future__ import annotations

import functools
from collections import namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import samples
from raggedfn import RaggedError
from raggedfn.data import TokenBudgetBatchSampler, collate

Pair = namedtuple("Pair", ["tokens", "label"])


def token_sample(i: int, n: int) -> dict:
    gen = torch.Generator().manual_seed(i)
    return {
        "tokens": torch.randn(n, 4, generator=gen),
        "ids": torch.randint(0, 100, (n,), generator=gen),
        "label": i % 3,
        "weight": 0.5 * i,
        "image": torch.randn(3, 2, generator=gen),
        "meta": (f"doc{i}", [i, n]),
    }


def assert_samples(x: raggedfn.Ragged, expected: list[torch.Tensor]) -> None:
    assert isinstance(x, raggedfn.Ragged)
    got = samples(x)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_batch(batch: dict, items: list[dict]) -> None:
    """``batch`` is the collated ``items``, checked leaf by leaf by hand."""
    assert_samples(batch["tokens"], [s["tokens"] for s in items])
    assert_samples(batch["ids"], [s["ids"] for s in items])
    assert torch.equal(batch["label"], torch.tensor([s["label"] for s in items]))
    assert batch["weight"].dtype == torch.float64
    assert torch.equal(
        batch["weight"], torch.tensor([s["weight"] for s in items], dtype=torch.float64)
    )
    assert torch.equal(batch["image"], torch.stack([s["image"] for s in items]))
    names, numbers = batch["meta"]
    assert names == [s["meta"][0] for s in items]
    assert torch.equal(numbers[0], torch.tensor([s["meta"][1][0] for s in items]))


def test_dict_of_tokens_numbers_and_equal_shapes() -> None:
    items = [token_sample(i, n) for i, n in enumerate([3, 0, 5, 1])]
    batch = collate(items)
    assert set(batch) == set(items[0])
    assert_batch(batch, items)
    assert isinstance(batch["meta"], tuple) and isinstance(batch["meta"][1], list)


def test_tensors_tuples_named_tuples() -> None:
    a, b = torch.ones(2, 3), torch.zeros(4, 3)
    assert_samples(collate([a, b]), [a, b])
    assert torch.equal(collate([a, a]), torch.stack([a, a]))
    out = collate([Pair(a, 1), Pair(b, 2)])
    assert isinstance(out, Pair)
    assert_samples(out.tokens, [a, b])
    assert torch.equal(out.label, torch.tensor([1, 2]))
    out = collate([(a, True), (b, False)])
    assert isinstance(out, tuple) and out[1].dtype == torch.bool


def test_numbers_and_numpy() -> None:
    assert collate([1, 2]).dtype == torch.int64
    assert collate([1.0, 2]).dtype == torch.float64
    assert collate([np.float32(1), np.float32(2)]).dtype == torch.float32
    out = collate([np.ones((2, 3)), np.ones((1, 3))])
    assert_samples(
        out, [torch.ones(2, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)]
    )
    assert torch.equal(collate([torch.tensor(1.5), torch.tensor(2.5)]), torch.tensor([1.5, 2.5]))


@settings(deadline=None, max_examples=60)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=6), declared=st.booleans())
def test_ragged_exactly_where_lengths_differ(lengths, declared) -> None:
    items = [
        torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + i for i, n in enumerate(lengths)
    ]
    out = collate(items, ragged=True) if declared else collate(items)
    if declared or len(set(lengths)) > 1:
        assert_samples(out, items)
    else:
        assert torch.equal(out, torch.stack(items))


def test_declared_ragged_keys_always_give_ragged() -> None:
    items = [{"tokens": torch.ones(2, 4), "mask": torch.ones(2)}]  # B = 1: nothing varies
    inferred = collate(items)
    assert isinstance(inferred["tokens"], torch.Tensor)
    declared = functools.partial(collate, ragged={"tokens"})(items)
    assert_samples(declared["tokens"], [items[0]["tokens"]])
    assert isinstance(declared["mask"], torch.Tensor) and declared["mask"].shape == (1, 2)
    assert_samples(collate([(torch.ones(2), 1)], ragged=[0])[0], [torch.ones(2)])


def test_declared_ragged_dims_for_images() -> None:
    images = [torch.randn(3, 4, 5), torch.randn(3, 2, 6)]
    out = collate([{"image": im} for im in images], ragged={"image": (2, 3)})
    assert out["image"].shape == (2, 3, None, None)
    assert_samples(out["image"], images)


def test_ragged_true_stacks_scalars() -> None:
    out = collate(
        [(torch.ones(2), torch.tensor(1.0)), (torch.ones(3), torch.tensor(2.0))], ragged=True
    )
    assert isinstance(out[0], raggedfn.Ragged)
    assert torch.equal(out[1], torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    ("batch", "kwargs", "message"),
    [
        ([], {}, "batch is empty"),
        (torch.ones(2, 3), {}, "batch must be a list of samples"),
        ([{"a": torch.ones(1)}, {"b": torch.ones(1)}], {}, r"batch of sample 1 has keys \['b'\]"),
        (
            [torch.ones(2), torch.ones(2, dtype=torch.int64)],
            {},
            "batch of sample 1 is a torch.int64",
        ),
        (
            [torch.ones(2, 3), torch.ones(3, 4)],
            {},
            r"batch: from_list: sample 1 has size 4 along axis 2",
        ),
        (
            [{"x": torch.ones(2)}, {"x": torch.ones(3)}],
            {"ragged": False},
            r"batch\['x'\] of sample 1 has shape \(3,\)",
        ),
        ([{"x": torch.ones(2)}], {"ragged": {"y"}}, "ragged names key 'y'"),
        ([torch.ones(2)], {"ragged": {"y"}}, "not a dict, tuple or list; use ragged=True"),
        ([torch.ones(2)], {"ragged": "x"}, "ragged must be None, a bool"),
        ([(torch.ones(2), 1), (torch.ones(2), "a")], {}, r"batch\[1\] of sample 1 is str"),
        ([(torch.ones(2),), (torch.ones(2), 1)], {}, "batch of sample 1 has 2 entries"),
        ([{"x": torch.tensor(1.0)}], {"ragged": {"x"}}, "0-d tensor, which has no axis"),
        ([object()], {}, "samples may hold tensors"),
        ([raggedfn.from_list([torch.ones(2)])], {}, "is a Ragged"),
    ],
)
def test_bad_batches(batch, kwargs, message) -> None:
    with pytest.raises(RaggedError, match=message) as error:
        collate(batch, **kwargs)
    assert str(error.value).startswith("collate: ")


# ----- through a DataLoader -----------------------------------------------------------------

LENGTHS = [3, 7, 1, 0, 6, 2, 5, 8, 4, 2, 9, 3]


class TokenDataset(torch.utils.data.Dataset):
    """Module level, so that spawned workers can unpickle it."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> dict:
        return token_sample(i, LENGTHS[i])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_with_two_workers(context) -> None:
    dataset = TokenDataset()
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens=12, seed=3)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(collate, ragged={"tokens", "ids"}),
        num_workers=2,
        multiprocessing_context=context,
    )
    batches = list(loader)
    assert len(batches) == len(sampler) > 2
    for batch, indices in zip(batches, sampler, strict=True):
        assert_batch(batch, [dataset[i] for i in indices])
