"""matmul / einsum: errors, immutability, gradcheck, pair-state reductions, layouts."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop, samples
from raggedfn import Layout, Ragged, RaggedError


def tokens(lengths, dim=3, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), dim, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def pair_state(lengths, channels=2, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([[n, n] for n in lengths], dtype=torch.int64).reshape(-1, 2)
    values = torch.randn(sum(n * n for n in lengths), channels, generator=gen, dtype=dtype)
    return raggedfn.from_sizes(values, sizes)


def test_weight_products_run_on_packed_values():
    x = tokens([2, 0, 3])
    w = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal((x @ w).values, x.values @ w)
    left = torch.randn(5, 2, dtype=torch.float64)
    xt = raggedfn.transpose(tokens([2, 0, 3], dim=2), 1, 2)  # (B, 2, N*)
    assert_same(left @ xt, [left @ s for s in samples(xt)])


def test_scores_and_contraction_shapes():
    q, k = tokens([2, 3, 0]), tokens([4, 1, 2], seed=1)
    scores = raggedfn.matmul(q, raggedfn.transpose(k, 1, 2))
    assert scores.shape == (3, None, None)
    assert scores.sizes.tolist() == [[2, 4], [3, 1], [0, 2]]
    out = raggedfn.matmul(scores, k)
    assert out.shape == (3, None, 3)
    assert_same(out, [a @ b.T @ b for a, b in zip(samples(q), samples(k), strict=True)])


def test_transposed_pair_state_is_read_through_its_layout():
    z = pair_state([3, 2], seed=2)
    zt = Ragged(
        z.values, z.offsets, z.sizes, Layout(tuple(reversed(z.layout.axes[:2])) + z.layout.axes[2:])
    )
    got = raggedfn.einsum("bikc,bjkc->bijc", zt, z)
    assert_same(got, loop(lambda a, b: torch.einsum("ikc,jkc->ijc", a, b), zt, z))


def test_large_batch_uses_several_buckets_and_matches():
    lengths = [
        int(n) for n in torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(3))
    ]
    z = pair_state(lengths, channels=2, dtype=torch.float32)
    got = raggedfn.einsum("bkic,bkjc->bijc", z, z)
    assert_same(
        got, loop(lambda a, b: torch.einsum("kic,kjc->ijc", a, b), z, z), rtol=1e-5, atol=1e-5
    )


def test_gradcheck_and_gradgradcheck_float64():
    z = pair_state([2, 0, 3, 1])
    q, k = tokens([2, 1, 3]), tokens([1, 3, 2], seed=4)

    def tri(values):
        return raggedfn.einsum(
            "bikc,bjkc->bijc", z.with_values(values), z.with_values(values)
        ).values

    def scores(qv, kv):
        s = raggedfn.einsum("bnd,bmd->bnm", q.with_values(qv), k.with_values(kv))
        return raggedfn.matmul(s, k.with_values(kv)).values

    zv = z.values.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(tri, (zv,))
    assert torch.autograd.gradgradcheck(tri, (zv,))
    qv, kv = q.values.clone().requires_grad_(True), k.values.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(scores, (qv, kv))
    assert torch.autograd.gradgradcheck(scores, (qv, kv))


def test_inputs_are_not_mutated():
    z = pair_state([3, 2])
    x = tokens([2, 3])
    versions = (z.values._version, x.values._version)
    raggedfn.einsum("bikc,bjkc->bijc", z, z)
    raggedfn.einsum("bnd,bmd->bnm", x, x)
    _ = x @ torch.randn(3, 2, dtype=torch.float64)
    assert (z.values._version, x.values._version) == versions


def test_pair_state_reductions_and_softmax_along_either_ragged_axis():
    """Issue #4 item 3 relies on the segment engineer's general ops working on R = 2."""
    z = pair_state([3, 0, 1, 4], channels=2)
    for dim in (1, 2):
        assert_same(raggedfn.softmax(z, dim), loop(lambda s, d=dim: torch.softmax(s, d - 1), z))
        assert_same(raggedfn.sum(z, dim), loop(lambda s, d=dim: s.sum(d - 1), z))
    zt = raggedfn.transpose(z, 1, 2)
    assert_same(zt, [s.transpose(0, 1) for s in samples(z)])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, y: raggedfn.einsum("b...d,bmd->bm", x, y), "ellipsis"),
        (lambda x, y: raggedfn.einsum("bnd,bmd", x, y), "must give the output explicitly"),
        (lambda x, y: raggedfn.einsum("bnd->bn", x, y), "names 1 operands, got 2"),
        (
            lambda x, y: raggedfn.einsum("bnd,cmd->bnm", x, y),
            "first subscript is the batch letter 'b'",
        ),
        (
            lambda x, y: raggedfn.einsum("bnd,bnd->bn", x, y),
            r"ragged axis 'n' has sizes \[2, 3\] in one operand and \[2, 2\]",
        ),
        (
            lambda x, y: raggedfn.einsum("bnd,nd->bn", x, torch.ones(2, 3)),
            r"letters \['n'\] are ragged in one operand and dense",
        ),
        (lambda x, y: raggedfn.einsum("bnd,bmd->nm", x, y), "must start with the batch letter"),
        (lambda x, y: raggedfn.einsum("bn,bmd->bnm", x, y), "operand 0 has 3 logical axes"),
        (
            lambda x, y: raggedfn.einsum("bnd,bmd->bnm", x, 3.0),
            "operand 1 must be a Ragged value or a tensor",
        ),
        (
            lambda x, y: raggedfn.matmul(x, torch.ones(2, 3, 4)),
            r"expected a dense right operand b of shape \[K\] or \[K, N\], got a torch.float32 tensor of shape \(2, 3, 4\)",
        ),
        (
            lambda x, y: raggedfn.matmul(raggedfn.einsum("bnd,bmd->bnm", x, y), torch.ones(2, 2)),
            "has a ragged contracted axis",
        ),
        (lambda x, y: raggedfn.matmul(x, "w"), "b must be a Ragged value or a tensor"),
    ],
)
def test_errors_name_function_argument_and_got(call, message):
    x, y = tokens([2, 3]), tokens([2, 2], seed=1)
    with pytest.raises(RaggedError, match=message):
        call(x, y)


def test_einsum_of_dense_tensors_is_torch_einsum():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    torch.testing.assert_close(raggedfn.einsum("ij,jk->ik", a, b), a @ b)


@pytest.mark.parametrize(
    ("lengths", "min_work", "per_sample"),
    [
        ([3, 0, 5], 600_000, True),
        ([2, 3, 4, 1, 5, 2, 3], 600_000, False),
        ([2, 3, 4, 1, 5, 2], 1, True),
    ],
    ids=["few-samples", "many-light-samples", "heavy-samples"],
)
def test_per_sample_views_or_buckets_by_batch_and_work(monkeypatch, lengths, min_work, per_sample):
    """Few samples or heavy ones: one einsum per sample on views (no bucket plan); otherwise
    buckets. Both equal the per-sample loop in values and gradients."""
    from raggedfn.ops import _bucket, _products

    planned = []
    real_plan = _bucket.plan
    monkeypatch.setattr(_bucket, "plan", lambda *a: planned.append(1) or real_plan(*a))
    monkeypatch.setattr(_products, "PER_SAMPLE_MIN_WORK", min_work)
    z = pair_state(lengths)
    leaf = z.values.clone().requires_grad_(True)
    out = raggedfn.einsum("bikc,bjkc->bijc", z.with_values(leaf), z.with_values(leaf))
    assert bool(planned) is not per_sample
    want = [torch.einsum("ikc,jkc->ijc", s, s) for s in samples(z)]
    assert_same(out, want)
    (got_grad,) = torch.autograd.grad(out.values.sum(), leaf)
    per = [s.clone().requires_grad_(True) for s in samples(z)]
    grads = torch.autograd.grad(sum(torch.einsum("ikc,jkc->ijc", s, s).sum() for s in per), per)
    torch.testing.assert_close(got_grad, torch.cat([g.reshape(-1, 2) for g in grads]))
