"""``randomness="same"`` of ``raggedfn.map``: every sample sees the same draws, whichever
plan group, chunk or per-sample loop runs it.

The reference is the per-sample loop in which every sample starts from the generator
state of the call (``torch.func.vmap``'s "one draw shared by the batch": a sample that
draws as the others do gets the same numbers).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.map_oracle import assert_restacked
from raggedfn import RaggedError

LENGTHS = (5, 2, 6, 1, 4, 3, 5, 2)


def _samples(lengths=LENGTHS, dim=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=gen, dtype=torch.float64) for n in lengths]


def _same_draw_loop(f, samples, state):
    out = []
    for s in samples:
        torch.set_rng_state(state)
        out.append(f(s.clone()))
    return out


def _check_same(f, lengths=LENGTHS, **kwargs):
    samples = _samples(lengths)
    x = raggedfn.from_list(samples)
    for seed in (123, 321):  # the call that traces, then a cached one
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
            got = raggedfn.map(f, x, randomness="same", **kwargs)
        assert_restacked(got, _same_draw_loop(f, samples, state))
    return got


def _branches(t):
    r = torch.rand(3, dtype=t.dtype)
    return r * 2 + t.sum() * 0 if t.shape[0] > 3 else r - 1 + t.sum() * 0


def _many_plans(t):
    n = t.shape[0]
    r = torch.rand(3, dtype=t.dtype)
    # six branches: four plans, the samples of the others run per sample
    for k in (5, 4, 3, 2, 1):
        if n > k:
            return r * k + t.sum() * 0
    return r + t.sum() * 0


def _pairs(t):
    return torch.rand(3, dtype=t.dtype) + (t @ t.T).sum() * 0


def test_same_draw_across_plan_groups():
    got = _check_same(_branches)
    # the samples of both plans see one draw
    assert torch.equal(got[0] / 2, got[1] + 1)


def test_same_draw_across_plans_and_the_per_sample_rest():
    got = _check_same(_many_plans)
    assert torch.allclose(got[0] / 4, got[3])  # n = 5 draws r * 4, n = 1 r


def test_same_draw_across_chunks():
    got = _check_same(_pairs, chunk_elements=30)
    assert torch.equal(got[0], got[2])


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(lambda t: torch.rand_like(t.sum(0)), id="rand_like"),
        pytest.param(lambda t: torch.randn_like(t.sum(0)) + t.sum(0), id="randn_like"),
        pytest.param(lambda t: F.dropout(t.sum(0) * 0 + 1, 0.5), id="dropout"),
        pytest.param(lambda t: torch.bernoulli(t.sum(0).sigmoid()), id="bernoulli"),
        # plans whose ragged size a guard fixed (their rules are tried in another order)
        pytest.param(lambda t: torch.rand_like(t.sum(0)) * len(t), id="pinned_len"),
        pytest.param(
            lambda t: torch.rand_like(t.sum(0)) * (2 if t.shape[0] == 5 else 1), id="pinned_eq"
        ),
    ],
)
def test_same_draw_of_a_fixed_shape_per_sample_value(f):
    # a random op on a dense per-sample value: one draw of the sample's shape
    _check_same(f)


def test_same_draw_in_the_whole_function_loop():
    def f(t):
        r = torch.rand(3, dtype=t.dtype)
        return r if bool(t.sum() > 0) else r * 3

    _check_same(f)


def test_same_refuses_a_draw_whose_shape_is_a_ragged_size():
    x = raggedfn.from_list(_samples())
    with pytest.raises(RaggedError, match="randomness='same'"):
        raggedfn.map(lambda t: torch.rand(t.shape[0]), x, randomness="same")


def test_different_draws_differ_across_plan_groups():
    # "different": every sample its own numbers, also in another plan group (a group
    # must not restart from the state the first one started from)
    x = raggedfn.from_list(_samples())
    torch.manual_seed(7)
    got = raggedfn.map(_branches, x, randomness="different")
    draws = [got[0] / 2] + [
        (got[i] / 2 if LENGTHS[i] > 3 else got[i] + 1) for i in range(1, len(LENGTHS))
    ]
    for i in range(len(draws)):
        for j in range(i):
            assert not torch.equal(draws[i], draws[j]), (i, j)


def test_same_leaves_an_uninitialised_cuda_alone(monkeypatch):
    # the CUDA generators are saved only where CUDA is initialised: a CPU program's map
    # must not initialise CUDA (get_rng_state_all would, on a machine with a GPU)
    def refuse():
        raise AssertionError("CUDA's generator states read while CUDA is not initialised")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", refuse)
    _check_same(_branches)
