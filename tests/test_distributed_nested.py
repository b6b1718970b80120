"""raggedfn.distributed on nested values (documents -> sentences -> tokens), 2 gloo processes.

As ``test_distributed.py``: one spawn runs every check on both ranks; each returns
its mismatches. Every rank builds every rank's data from fixed per-level lengths
(partitions computed by hand, ``nested_strategies.build``), so references are the
canonical per-sample forms (``nested_reference.canonical``, read from the raw
partitions) concatenated or split as the collective moves samples.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import raggedfn
from property_tests.nested_reference import canonical
from property_tests.nested_strategies import build
from raggedfn.distributed import all_gather, all_to_all
from tests import gloo_ranks

WORLD = 2
D = 3

# per case and rank: (per-level lengths, rectangular levels, splits for all_to_all)
CASES: dict[str, list[tuple[list[list[int]], tuple[int, ...], list[int]]]] = {
    "documents": [
        ([[2, 0, 1], [1, 3, 2]], (), [1, 2]),
        ([[1, 2], [0, 2, 1]], (), [2, 0]),
    ],
    "empty rank": [([[2, 1], [1, 0, 2]], (), [0, 2]), ([[], []], (), [0, 0])],
    "three levels": [
        ([[1, 2], [2, 1, 0], [1, 0, 3]], (), [2, 0]),
        ([[2], [1, 2], [2, 1, 1]], (), [0, 1]),
    ],
    "pair states": [  # r0 n1 r2: every sentence an L x L rectangle
        ([[2, 1], [2, 1, 3], [2, 2, 1, 3, 3, 3]], (2,), [1, 1]),
        ([[1], [2], [2, 2]], (2,), [1, 0]),
    ],
    # more sizes entries than the header holds inline: a sizes exchange of their own
    "many": [
        ([[1] * 1100, [i % 3 for i in range(1100)]], (), [600, 500]),
        ([[2, 1], [1, 1, 1]], (), [1, 1]),
    ],
}


def _value(case: str, rank: int) -> raggedfn.Ragged:
    lengths, rectangular, _ = CASES[case][rank]
    gen = torch.Generator().manual_seed(7 * rank + len(case))
    values = torch.randn(sum(lengths[-1]), D, generator=gen, dtype=torch.float64)
    return build(lengths, values, rectangular)


def _compare(
    name: str, got: raggedfn.Ragged, expected: list[Any], like: raggedfn.Ragged
) -> list[str]:
    problems = []
    if got.layout != like.layout:
        problems.append(f"{name}: layout {got.layout}, expected {like.layout}")
    try:
        raggedfn.check(got)
    except raggedfn.RaggedError as error:
        return [*problems, f"{name}: {error}"]
    found = canonical(got)
    if len(found) != len(expected):
        return [*problems, f"{name}: {len(found)} samples, expected {len(expected)}"]
    for i, ((keys, rows), (want_keys, want_rows)) in enumerate(zip(found, expected, strict=True)):
        if keys != want_keys:
            problems.append(f"{name}: sample {i} structure {keys} != {want_keys}")
        elif not all(torch.equal(a, b) for a, b in zip(rows, want_rows, strict=True)):
            problems.append(f"{name}: sample {i} rows differ")
    return problems


def _weights(rank: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, D, generator=gen, dtype=torch.float64)


def _sent(x: raggedfn.Ragged, splits: list[int], to: int) -> tuple[int, int]:
    """The samples and rows of ``x`` that go to rank ``to``: (first row, rows)."""
    start = sum(splits[:to])
    a, b = int(x.offsets[start]), int(x.offsets[start + splits[to]])
    return a, b - a


def check_all_gather_nested(rank: int) -> list[str]:
    problems = []
    for case in CASES:
        xs = [_value(case, r) for r in range(WORLD)]
        values = xs[rank].values.clone().requires_grad_()
        got = all_gather(xs[rank].with_values(values))
        expected = [s for x in xs for s in canonical(x)]
        problems += _compare(f"{case} all_gather", got, expected, xs[0])
        # every rank weighs the gathered rows differently; the loss sums over ranks
        (got.values * _weights(rank, got.values.shape[0])).sum().backward()
        rows = [x.values.shape[0] for x in xs]
        start = sum(rows[:rank])
        want = sum(_weights(r, sum(rows))[start : start + rows[rank]] for r in range(WORLD))
        if values.grad is None or not torch.allclose(values.grad, want):
            problems.append(f"{case} all_gather: gradient differs")
    return problems


def check_all_to_all_nested(rank: int) -> list[str]:
    problems = []
    for case, per_rank in CASES.items():
        xs = [_value(case, r) for r in range(WORLD)]
        splits = [entry[2] for entry in per_rank]
        values = xs[rank].values.clone().requires_grad_()
        got = all_to_all(xs[rank].with_values(values), splits[rank])
        expected = []
        for source in range(WORLD):
            start = sum(splits[source][:rank])
            expected += canonical(xs[source])[start : start + splits[source][rank]]
        problems += _compare(f"{case} all_to_all", got, expected, xs[0])
        (got.values * _weights(rank, got.values.shape[0])).sum().backward()
        want = []
        for to in range(WORLD):  # where every run of this rank's rows went, and its weights
            before = sum(_sent(xs[s], splits[s], to)[1] for s in range(rank))
            rows = _sent(xs[rank], splits[rank], to)[1]
            total = sum(_sent(xs[s], splits[s], to)[1] for s in range(WORLD))
            want.append(_weights(to, total)[before : before + rows])
        if values.grad is None or not torch.allclose(values.grad, torch.cat(want)):
            problems.append(f"{case} all_to_all: gradient differs")
        # sending the samples back with the receive side known gives x again
        came = [splits[s][rank] for s in range(WORLD)]
        back = all_to_all(
            got.detach(), came, output_splits=splits[rank], output_sizes=xs[rank].sizes
        )
        problems += _compare(f"{case} back", back, canonical(xs[rank]), xs[0])
    return problems


CHECKS = gloo_ranks.checks_of(globals())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    return gloo_ranks.run_checks(CHECKS, WORLD, tmp_path_factory.mktemp("gloo"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_two_ranks(name: str, results: list[dict[str, list[str]]]) -> None:
    assert [r[name] for r in results] == [[]] * WORLD
