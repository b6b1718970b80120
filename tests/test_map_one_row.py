"""Samples that break a guard of the first plan only through a comparison that cannot
change what ``f`` computes (a sample of one row, where Hugging Face's attention code
asks ``q_length > 1``) run on that plan, batched with the others: a trace on their
sizes proves it runs the same ops. Where the comparison does change the ops or their
arguments, they keep a plan of their own. Every case equals the per-sample loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop

D = 6
W = torch.randn(D, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
CAUSAL = False
BUFFER = torch.arange(64).expand(1, -1)  # a position buffer, sliced as transformers does


def tokens(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in lengths]
    )


def hf_like(t, w):
    """The shape of a Hugging Face layer: a batch axis of one, heads, a position buffer
    sliced to the length, and ``is_causal = q_length > 1 and ... and CAUSAL``."""
    h = t[None]  # [1, N, D]
    n = h.shape[1]
    positions = BUFFER[:, :n].expand(1, n)  # sizes compared with 1 inside torch
    h = h + positions[..., None].to(h.dtype) / 64
    q = F.linear(h, w).view(1, n, 2, D // 2).transpose(1, 2)  # [1, 2, N, 3]
    causal = q.shape[2] > 1 and CAUSAL
    out = F.scaled_dot_product_attention(q, q, q, is_causal=causal)
    return out.transpose(1, 2).reshape(1, n, D)[0]


def scaled_by_length_class(t):
    # the comparison changes an argument: one row takes another factor
    return t * 2 if t.shape[0] > 1 else t * 3


def other_ops_for_one_row(t):
    return t.cumsum(0) if t.shape[0] > 1 else t.exp()


def test_one_row_samples_run_on_the_plan_of_the_longer_ones(capfd):
    raggedfn.map(hf_like, tokens([5, 7, 3]), W, in_dims=(0, None))
    plans = raggedfn.map_cache_info(hf_like).plans
    for lengths in ([1, 2], [4, 1, 6, 1], [1], [1, 1, 3]):
        x = tokens(lengths, seed=len(lengths))
        report = raggedfn.map_report(hf_like, x, W, in_dims=(0, None))
        assert report.fully_batched, str(report)
        assert_same(report.output, loop(lambda t: hf_like(t, W), x))
        assert_same(raggedfn.map(hf_like, x, W, in_dims=(0, None)), report.output)
    # no plan of their own: the first plan took them
    assert raggedfn.map_cache_info(hf_like).plans == plans
    assert "Warning" not in capfd.readouterr().err


def test_a_comparison_that_changes_an_argument_keeps_its_own_plan():
    raggedfn.map(scaled_by_length_class, tokens([5, 4]))
    x = tokens([3, 1, 2, 1])
    report = raggedfn.map_report(scaled_by_length_class, x)
    assert_same(report.output, loop(scaled_by_length_class, x))
    assert raggedfn.map_cache_info(scaled_by_length_class).plans == 2


def test_a_comparison_that_changes_the_ops_keeps_its_own_plan():
    raggedfn.map(other_ops_for_one_row, tokens([5, 4]))
    x = tokens([1, 3, 1])
    assert_same(raggedfn.map(other_ops_for_one_row, x), loop(other_ops_for_one_row, x))
    assert raggedfn.map_cache_info(other_ops_for_one_row).plans == 2


def fixed_rows_attention(t):
    """Attention over fixed-shape samples (3 rows), heads split, with a mask computed
    from the data and one shared causal mask."""
    h = t.view(3, 2, D // 2).transpose(0, 1)[None]  # [1, 2, 3, 3]
    data_mask = (h.sum(-1, keepdim=True) > -1.0) | torch.eye(3, dtype=torch.bool)
    shared = torch.ones(3, 3, dtype=torch.bool).tril()
    a = F.scaled_dot_product_attention(h, h, h, attn_mask=data_mask)
    b = F.scaled_dot_product_attention(h, h, h, attn_mask=shared, scale=0.5)
    c = F.scaled_dot_product_attention(h[0], h[0], h[0], is_causal=True)
    return a + b + c


def test_fixed_shape_attention_is_one_kernel_call(capfd):
    x = torch.randn(4, 3, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    report = raggedfn.map_report(fixed_rows_attention, x)
    assert report.fully_batched, str(report)
    assert report.attention == {"fused with a mask": 2, "fused": 1}, report.attention
    want = torch.stack([fixed_rows_attention(s) for s in x])
    torch.testing.assert_close(report.output, want, atol=1e-12, rtol=0)
    assert "Warning" not in capfd.readouterr().err
