"""matmul / einsum equal the per-sample loop in values and gradients."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._pairs_helpers import check_against_loop, like, tokens_for
from property_tests.reference import assert_same, samples
from property_tests.strategies import raggeds

DTYPES = st.sampled_from([torch.float64, torch.float32])
FAST = settings(deadline=None, max_examples=30)


@FAST
@given(raggeds(num_ragged=1, feature_shape=(3,), dtype=DTYPES, dim_order="ragged_first"), st.data())
def test_scores_and_contraction(x, data):
    y = data.draw(tokens_for(x.batch_size, (3,), x.dtype))
    check_against_loop(
        lambda a, b: raggedfn.matmul(a, raggedfn.transpose(b, 1, 2)), lambda a, b: a @ b.T, x, y
    )
    check_against_loop(
        lambda a, b: raggedfn.einsum("bnd,bmd->bnm", a, b), lambda a, b: a @ b.T, x, y
    )
    scores = raggedfn.einsum("bnd,bmd->bnm", x, y)
    check_against_loop(raggedfn.matmul, torch.matmul, scores, y)
    check_against_loop(lambda p, v: p @ v, torch.matmul, scores, y)


@FAST
@given(
    raggeds(num_ragged=2, feature_shape=(3,), dtype=DTYPES, dim_order="ragged_first", square=True)
)
def test_triangle_updates(z):
    w = like(z, seed=7)
    check_against_loop(
        lambda a, b: raggedfn.einsum("bikc,bjkc->bijc", a, b),
        lambda a, b: torch.einsum("ikc,jkc->ijc", a, b),
        z,
        w,
    )
    check_against_loop(
        lambda a, b: raggedfn.einsum("bkic,bkjc->bijc", a, b),
        lambda a, b: torch.einsum("kic,kjc->ijc", a, b),
        z,
        w,
    )


@FAST
@given(raggeds(num_ragged=st.sampled_from([1, 2]), feature_shape=(2, 3), dtype=DTYPES))
def test_dense_weights_any_layout(x):
    weight = torch.randn(3, 4, dtype=x.dtype)
    left = torch.randn(5, 2, dtype=x.dtype)
    shape = x.shape
    if shape[-1] == 3:
        check_against_loop(lambda a: a @ weight, lambda a: a @ weight, x)
    if shape[-2] == 2:
        check_against_loop(lambda a: left @ a, lambda a: left @ a, x)
    letters = "pqrs"[: x.ndim - 1]
    # the first sample axis moves last: a copy whenever it is ragged (bucketed path)
    eq = f"b{letters}->b{letters[1:]}{letters[0]}"
    check_against_loop(
        lambda a: raggedfn.einsum(eq, a), lambda a: torch.einsum(eq[1:].replace("b", ""), a), x
    )


@FAST
@given(raggeds(num_ragged=1, feature_shape=(3,), dtype=DTYPES, dim_order="standard"))
def test_einsum_to_dense_and_batched_dense(x):
    y = like(x, seed=3)
    check_against_loop(
        lambda a, b: raggedfn.einsum("bnd,bnd->bd", a, b),
        lambda a, b: torch.einsum("nd,nd->d", a, b),
        x,
        y,
    )
    per_sample = torch.randn(x.batch_size, 3, dtype=x.dtype)
    got = raggedfn.einsum("bnd,bd->bn", x, per_sample)
    expected = [torch.einsum("nd,d->n", s, per_sample[i]) for i, s in enumerate(samples(x))]
    assert_same(got, expected)
