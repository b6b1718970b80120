"""The variable-length attention custom op (``_prims.varlen_attention``) used under compile."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import raggedfn
from raggedfn import RaggedError, _prims
from raggedfn._prims import _varlen

Q_LENGTHS, K_LENGTHS = [3, 0, 5, 1, 2], [4, 2, 0, 1, 6]


def assert_same_grads(got, want, leaves, cotangent):
    """The gradients of ``got`` and ``want`` with respect to ``leaves`` agree."""
    options = {"allow_unused": True, "materialize_grads": True}
    for g, w in zip(
        torch.autograd.grad(got, leaves, cotangent, **options),
        torch.autograd.grad(want, leaves, cotangent, **options),
        strict=True,
    ):
        torch.testing.assert_close(g, w)


def packed(lengths, seed, dtype=torch.float64, heads=2, dim=3):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), heads, dim, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values.requires_grad_(True), torch.tensor(lengths))


def reference(q, k, v, causal):
    """torch SDPA on each sample alone; zeros where a sample has no keys."""
    outs = []
    for qs, ks, vs in zip(raggedfn.unbind(q), raggedfn.unbind(k), raggedfn.unbind(v), strict=True):
        if ks.shape[0] == 0:
            outs.append(qs * 0)  # zeros, still connected to q
            continue
        heads = [t.transpose(0, 1) for t in (qs, ks, vs)]
        outs.append(F.scaled_dot_product_attention(*heads, is_causal=causal).transpose(0, 1))
    return torch.cat(outs)


def run(q, k, v, causal):
    return _prims.varlen_attention(
        q.values, k.values, v.values, q.offsets, k.offsets, v.offsets, causal
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("q_lengths", "k_lengths"),
    [(Q_LENGTHS, K_LENGTHS), ([4, 4, 4], [4, 4, 4]), ([2, 2], [5, 5]), ([3, 3], [0, 0])],
    ids=["distinct", "equal", "equal-n-m", "no-keys"],
)
def test_equals_per_sample_sdpa_in_values_and_gradients(dtype, causal, q_lengths, k_lengths):
    """Distinct lengths loop over samples; equal lengths take one batched kernel call."""
    q, k = packed(q_lengths, 0, dtype), packed(k_lengths, 1, dtype)
    v = packed(k_lengths, 2, dtype)
    got = run(q, k, v, causal)
    want = reference(q, k, v, causal)
    torch.testing.assert_close(got, want)
    assert_same_grads(got, want, [q.values, k.values, v.values], torch.randn_like(got))


def test_gradcheck_float64_and_double_backward_refused():
    q, k, v = packed([3, 2], 0), packed([2, 4], 1), packed([2, 4], 2)
    offsets = (q.offsets, k.offsets, v.offsets)

    def fn(a, b, c):
        return _prims.varlen_attention(a, b, c, *offsets, True)

    assert torch.autograd.gradcheck(fn, (q.values, k.values, v.values))
    equal = packed([3, 3], 3)
    assert torch.autograd.gradcheck(
        lambda t: _prims.varlen_attention(t, t, t, *(equal.offsets,) * 3, True), (equal.values,)
    )
    (grad,) = torch.autograd.grad(
        fn(q.values, k.values, v.values).sum(), q.values, create_graph=True
    )
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(grad.sum(), q.values)


def test_mismatched_key_and_value_partitions_raise():
    q, k, v = packed([3, 2], 0), packed([2, 4], 1), packed([4, 2], 2)
    with pytest.raises(RaggedError, match="k and v must have the same partition"):
        run(q, k, v, False)


def test_partition_errors_name_attention():
    """Both refusals are prefixed by the op's name, as every RaggedError is."""
    q, k, v = packed([3, 2], 0), packed([2, 4], 1), packed([4, 2], 2)
    with pytest.raises(RaggedError, match=r"^attention: k and v must have the same partition"):
        run(q, k, v, False)
    q3 = packed([3, 2, 1], 3)
    with pytest.raises(RaggedError, match=r"^attention: q, k and v must have the same batch size"):
        run(q3, k, k, False)


def test_compiled_plain_attention_uses_the_varlen_op_and_other_cases_the_planned_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def plain(q, k, v):
        return raggedfn.attention(q, k, v, causal=True).values

    def masked(q, k, v, kp):
        return raggedfn.attention(q, k, v, key_padding=kp).values

    q, k, v = packed(Q_LENGTHS, 0), packed(K_LENGTHS, 1), packed(K_LENGTHS, 2)
    kp = raggedfn.from_lengths(torch.arange(sum(K_LENGTHS)) % 2 == 0, torch.tensor(K_LENGTHS))
    torch._dynamo.reset()
    torch.testing.assert_close(
        torch.compile(plain, backend=backend, fullgraph=True)(q, k, v), plain(q, k, v)
    )
    assert "varlen_attention" in graphs[-1] and "host_planned" not in graphs[-1]
    torch.testing.assert_close(
        torch.compile(masked, backend=backend, fullgraph=True)(q, k, v, kp), masked(q, k, v, kp)
    )
    assert "host_planned" in graphs[-1] and "varlen_attention" not in graphs[-1]


@pytest.mark.parametrize("unit_stride", [True, False], ids=["views", "strided-d-copies"])
def test_per_sample_heads_are_views_unless_d_is_strided(unit_stride):
    """The loop hands the kernel ``[1, H, N, D]`` views of the packed rows when ``D`` has
    unit stride (no per-sample copies, forward or backward) and copies otherwise; both
    equal SDPA per sample in values and gradients."""
    q, k, v = packed(Q_LENGTHS, 0, dim=4), packed(K_LENGTHS, 1, dim=4), packed(K_LENGTHS, 2, dim=4)
    if not unit_stride:  # same numbers, D strided: [T, D, H] storage seen as [T, H, D]
        q, k, v = (
            t.with_values(t.values.detach().transpose(1, 2).contiguous().transpose(1, 2))
            for t in (q, k, v)
        )
        for t in (q, k, v):
            assert t.values.stride(-1) != 1
            t.values.requires_grad_(True)
    rows = q.values.detach()[:8]
    views = _varlen._head_views(rows, [3, 5])
    assert [t.shape for t in views] == [(1, 2, 3, 4), (1, 2, 5, 4)]
    assert (views[1].data_ptr() == rows[3:8].data_ptr()) == unit_stride
    got = run(q, k, v, False)
    want = reference(q, k, v, False)
    torch.testing.assert_close(got, want)
    assert_same_grads(got, want, [q.values, k.values, v.values], torch.randn_like(got))


@pytest.mark.parametrize(
    ("q_lengths", "k_lengths"),
    [(Q_LENGTHS, K_LENGTHS), ([4, 4, 4], [4, 4, 4])],
    ids=["distinct", "equal"],
)
def test_a_mask_equals_per_sample_sdpa_with_it(q_lengths, k_lengths):
    """A boolean [N_b, M_b] mask per sample (packed row-major), shared by the heads: equal
    to torch's SDPA on each sample with that mask, in values and gradients; a sample whose
    mask is True everywhere runs without it, a query with every key masked gets zeros."""
    q, k = packed(q_lengths, 0), packed(k_lengths, 1)
    v = packed(k_lengths, 2)
    gen = torch.Generator().manual_seed(3)
    masks = [
        torch.rand(n, m, generator=gen) > 0.4 for n, m in zip(q_lengths, k_lengths, strict=True)
    ]
    masks[0] = torch.ones_like(masks[0])  # nothing masked
    masks[-1][0] = False  # a query with no key
    got = _prims.varlen_attention(
        q.values, k.values, v.values, q.offsets, k.offsets, v.offsets, False, None,
        torch.cat([m.reshape(-1) for m in masks]),
    )  # fmt: skip
    outs = []
    for qs, ks, vs, m in zip(*(raggedfn.unbind(t) for t in (q, k, v)), masks, strict=True):
        if ks.shape[0] == 0:
            outs.append(qs * 0)
            continue
        heads = [t.transpose(0, 1) for t in (qs, ks, vs)]
        outs.append(F.scaled_dot_product_attention(*heads, attn_mask=m).transpose(0, 1))
    want = torch.cat(outs)
    torch.testing.assert_close(got, want)
    assert_same_grads(got, want, [q.values, k.values, v.values], torch.randn_like(got))


def test_a_mask_of_the_wrong_size_is_refused():
    q = packed([2, 3], 0)
    with pytest.raises(RaggedError, match="the mask has 5 entries for 13 pairs"):
        _prims.varlen_attention(
            q.values, q.values, q.values, q.offsets, q.offsets, q.offsets, False, None,
            torch.ones(5, dtype=torch.bool),
        )  # fmt: skip


def test_a_mask_true_everywhere_keeps_the_one_batched_call(monkeypatch):
    """Equal lengths and a mask that masks nothing: no sample has a mask, so the one
    batched kernel call runs (as without a mask), in values and gradients equal to
    torch's SDPA on each sample without a mask."""
    calls = []
    real = _varlen._batched
    monkeypatch.setattr(_varlen, "_batched", lambda *a: calls.append(1) or real(*a))
    lengths = [4, 4, 4]
    q, k, v = (packed(lengths, seed) for seed in (0, 1, 2))
    mask = torch.ones(sum(n * n for n in lengths), dtype=torch.bool)
    got = _prims.varlen_attention(
        q.values, k.values, v.values, q.offsets, k.offsets, v.offsets, False, None, mask
    )
    assert calls, "the batched kernel call did not run"
    want = reference(q, k, v, False)
    torch.testing.assert_close(got, want)
    cotangent = torch.randn_like(got)
    leaves = [q.values, k.values, v.values]
    calls.clear()
    for g, w in zip(
        torch.autograd.grad(got, leaves, cotangent),
        torch.autograd.grad(want, leaves, cotangent),
        strict=True,
    ):
        torch.testing.assert_close(g, w)
    assert calls, "the batched backward call did not run"
