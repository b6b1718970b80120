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
        (
            [raggedfn.from_list([torch.ones(2)]), torch.ones(2)],
            {},
            "batch of sample 1 is a torch.float32",
        ),
        (
            [{"x": raggedfn.from_list([torch.ones(2)])}],
            {"ragged": {"x": (2,)}},
            r"batch\['x'\] holds Ragged samples, which keep their own ragged axes",
        ),
        (
            [raggedfn.from_list([torch.ones(2)]), raggedfn.from_list([torch.ones(2, 3)])],
            {},
            r"batch: from_list: Ragged sample 1 has logical shape",
        ),
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


# ----- Ragged samples: one nesting level deeper -----------------------------------------------


def document_sample(i: int) -> dict:
    """A document: its sentences ``(S, L*, 4)`` and their pair states ``(S, L*, L*)``."""
    gen = torch.Generator().manual_seed(100 + i)
    lengths = [int(n) for n in torch.randint(0, 4, (i % 4,), generator=gen)]
    sentences = [torch.randn(n, 4, generator=gen) for n in lengths]
    pairs = [torch.randn(n, n, generator=gen) for n in lengths]
    return {
        "sentences": raggedfn.from_list(sentences) if sentences else _no_sentences(4),
        "pairs": raggedfn.from_list(pairs, ragged_dims=(1, 2)) if pairs else _no_pairs(),
        "label": i % 2,
    }


def _no_sentences(width: int) -> raggedfn.Ragged:
    return raggedfn.from_lengths(torch.zeros(0, width), torch.zeros(0, dtype=torch.int64))


def _no_pairs() -> raggedfn.Ragged:
    return raggedfn.from_sizes(torch.zeros(0), torch.zeros(0, 2, dtype=torch.int64))


def assert_documents(batch: dict, items: list[dict]) -> None:
    """Sample ``i`` of each nested leaf is item ``i``'s Ragged value, checked by hand."""
    for key, letters in (("sentences", "r0 n1 d0"), ("pairs", "r0 n1 r2")):
        x = batch[key]
        assert isinstance(x, raggedfn.Ragged) and x.layout.code == letters
        raggedfn.check(x)
        assert x.batch_size == len(items)
        for i, item in enumerate(items):
            want, got = item[key], x[i]
            assert got.layout == want.layout and got.batch_size == want.batch_size
            assert torch.equal(got.sizes, want.sizes) and torch.equal(got.offsets, want.offsets)
            assert torch.equal(got.values, want.values)
    assert torch.equal(batch["label"], torch.tensor([s["label"] for s in items]))


@pytest.mark.parametrize("ragged", [None, True, False, {"sentences", "pairs"}])
def test_ragged_samples_nest_one_level_deeper(ragged) -> None:
    items = [document_sample(i) for i in range(5)]  # 0 to 3 sentences, empty ones too
    assert_documents(collate(items, ragged=ragged), items)
    one = collate(items[1:2])  # B = 1 nests too: Ragged samples are never stacked
    assert one["sentences"].batch_size == 1 and one["sentences"].is_nested


class DocumentDataset(torch.utils.data.Dataset):
    """Module level, so that spawned workers can unpickle it."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        return document_sample(i)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_of_ragged_samples_with_two_workers(context) -> None:
    dataset = DocumentDataset()
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=3, collate_fn=collate, num_workers=2, multiprocessing_context=context
    )
    batches = list(loader)
    assert len(batches) == 4
    for n, batch in enumerate(batches):
        assert_documents(batch, [dataset[i] for i in range(3 * n, min(3 * n + 3, 10))])
