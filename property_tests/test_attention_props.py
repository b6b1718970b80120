"""attention equals torch SDPA run on each sample alone, in values and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests._pairs_helpers import check_against_loop, like, tokens_for
from raggedfn import Ragged
from raggedfn.ops import _attention

DTYPES = st.sampled_from([torch.float64, torch.float32])
HEADS, DIM = 2, 3


def sdpa_sample(q, k, v, bias=None, key_padding=None, causal=False, scale=None):
    """One sample: q [N, H, Dh], k/v [M, H, *], bias [N, M, H], key_padding [M]."""
    n, m = q.shape[0], k.shape[0]
    keep = torch.ones(n, m, dtype=torch.bool)
    if key_padding is not None:
        keep = keep & ~key_padding[None, :]
    if causal:
        keep = keep & torch.ones(n, m, dtype=torch.bool).tril()
    mask = keep
    if bias is not None:
        mask = torch.where(keep, bias.permute(2, 0, 1), float("-inf"))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


@st.composite
def problems(draw):
    dtype = draw(DTYPES)
    lengths = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    batch = len(lengths)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = raggedfn.from_lengths(
        torch.randn(sum(lengths), HEADS, DIM, generator=gen, dtype=torch.float64).to(dtype),
        torch.tensor(lengths, dtype=torch.int64),
    )
    same = draw(st.booleans())
    k = like(q, seed=1) if same else draw(tokens_for(batch, (HEADS, DIM), dtype))
    v = like(k, seed=2, shape=(HEADS, 4))
    pair_sizes = torch.stack([q.sizes[:, 0], k.sizes[:, 0]], dim=1)
    pair_count = int((pair_sizes[:, 0] * pair_sizes[:, 1]).sum())
    bias = raggedfn.from_sizes(
        torch.randn(pair_count, HEADS, generator=gen, dtype=torch.float64).to(dtype), pair_sizes
    )
    padding = Ragged(
        torch.rand(k.values.shape[0], generator=gen) < 0.4,
        k.offsets,
        k.sizes,
        raggedfn.Layout.standard(1, 0),
    )
    return q, k, v, bias, padding


@settings(deadline=None, max_examples=40)
@given(problems(), st.booleans(), st.booleans(), st.booleans())
def test_attention_matches_per_sample_sdpa(problem, with_bias, with_padding, causal):
    check_problem(problem, with_bias, with_padding, causal)


def check_problem(problem, with_bias, with_padding, causal, scale=None, **tolerance):
    """attention on ``problems()`` (bias and key padding optional) vs SDPA per sample."""
    q, k, v, bias, padding = problem
    inputs = [q, k, v] + ([bias] if with_bias else []) + ([padding] if with_padding else [])

    def unpack(args):
        q, k, v, *rest = args
        b = rest.pop(0) if with_bias else None
        p = rest.pop(0) if with_padding else None
        return q, k, v, b, p

    def ragged_op(*args):
        q, k, v, b, p = unpack(args)
        return raggedfn.attention(q, k, v, bias=b, key_padding=p, causal=causal, scale=scale)

    def reference(*args):
        q, k, v, b, p = unpack(args)
        return sdpa_sample(q, k, v, b, p, causal, scale)

    check_against_loop(ragged_op, reference, *inputs, **tolerance)


@settings(deadline=None, max_examples=25)
@given(problems(), st.floats(0.1, 2.0))
def test_dense_bias_and_scale(problem, scale):
    q, k, v, _, _ = problem
    head_bias = torch.randn(HEADS, 1, 1, dtype=q.dtype)

    def reference(q, k, v):
        n, m = q.shape[0], k.shape[0]
        return sdpa_sample(q, k, v, head_bias.permute(1, 2, 0).expand(n, m, HEADS), scale=scale)

    check_against_loop(
        lambda q, k, v: raggedfn.attention(q, k, v, bias=head_bias, scale=scale), reference, q, k, v
    )


@settings(deadline=None, max_examples=25)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=3), st.integers(0, 2**31 - 1), DTYPES)
def test_triangle_rows_share_the_pair_bias(sizes, seed, dtype):
    """q, k, v (B, I*, N*, H, Dh) with I = N: each row attends with bias (B, N*, N*, H)."""
    gen = torch.Generator().manual_seed(seed)
    square = torch.tensor([[n, n] for n in sizes], dtype=torch.int64).reshape(-1, 2)
    count = sum(n * n for n in sizes)

    def state(*dense):
        values = torch.randn(count, *dense, generator=gen, dtype=torch.float64).to(dtype)
        return raggedfn.from_sizes(values, square)

    q, k, v, bias = state(HEADS, DIM), state(HEADS, DIM), state(HEADS, DIM), state(HEADS)

    def reference(q, k, v, b):
        rows = [sdpa_sample(q[i], k[i], v[i], b) for i in range(q.shape[0])]
        return torch.stack(rows) if rows else q.new_zeros(q.shape)

    check_against_loop(
        lambda q, k, v, b: raggedfn.attention(q, k, v, bias=b), reference, q, k, v, bias
    )
    saved = _attention.CHUNK_LOGITS
    _attention.CHUNK_LOGITS = 1  # one row per SDPA call
    try:
        check_against_loop(
            lambda q, k, v, b: raggedfn.attention(q, k, v, bias=b), reference, q, k, v, bias
        )
    finally:
        _attention.CHUNK_LOGITS = saved
