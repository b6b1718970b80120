"""Which path ``scaled_dot_product_attention`` takes inside ``raggedfn.map``, and that each
path equals the per-sample loop: masks built inside ``f`` from positions (causal from
``arange``/``tril``/``triu``, sliding, chunked and bidirectional windows, additive) and
from the data run torch's kernels per sample (or per length bucket) with each sample's
mask; dropout draws per sample; the pair formulation is what is left, and warns when it
is estimated slower than the padded batch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, samples
from raggedfn import RaggedError, RaggedPerformanceWarning
from raggedfn._map.rules import _attention as _rules_attention
from raggedfn._map.rules import _lazy_pairs
from raggedfn.ops import _attention_masked

LENGTHS = (5, 9, 3, 1, 7)
WITH_EMPTY = (5, 0, 9, 3)  # an empty sample fails a guard of the mask's trace: run alone
H, D = 2, 4


def _x(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, H, D, generator=gen, dtype=torch.float64) for n in lengths]
    )


def _grid(n):
    i = torch.arange(n)
    return i[:, None], i[None, :]


MASKS = {
    "causal arange": lambda t, n: (lambda i, j: j <= i)(*_grid(n)),
    "causal tril": lambda t, n: torch.ones(n, n, dtype=torch.bool).tril(),
    "causal triu": lambda t, n: ~torch.ones(n, n, dtype=torch.bool).triu(1),
    "sliding window": lambda t, n: (lambda i, j: (j <= i) & (i - j < 3))(*_grid(n)),
    "chunked": lambda t, n: (lambda i, j: i // 4 == j // 4)(*_grid(n)),
    "bidirectional window": lambda t, n: (lambda i, j: (i - j).abs() <= 2)(*_grid(n)),
    "additive causal": lambda t, n: torch.zeros(n, n, dtype=t.dtype).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")
    ),
    # from the data: a key takes part where its first feature is positive (and itself)
    "data": lambda t, n: (t[:, 0, 0] > 0)[None, :] | torch.eye(n, dtype=torch.bool),
    "per head": lambda t, n: torch.stack(
        [torch.ones(n, n, dtype=torch.bool).tril(), torch.ones(n, n, dtype=torch.bool)]
    ),
}


def _attend(kind, rank=4):
    def f(t):
        n = t.shape[0]
        mask = MASKS[kind](t, n)
        h = t.transpose(0, 1)  # [H, N, D]
        if mask.ndim == 2:
            mask = mask[None]
        if rank == 4:
            h, mask = h[None], mask[None]
        out = F.scaled_dot_product_attention(h, h * 0.5, h, attn_mask=mask)
        return (out[0] if rank == 4 else out).transpose(0, 1)

    return f


def _check_loop(f, x, **kwargs):
    """map's values and float64 gradients equal the per-sample loop's."""
    leaf = x.values.detach().requires_grad_()
    got = raggedfn.map(f, x.with_values(leaf), **kwargs)
    parts = [s.detach().requires_grad_() for s in samples(x)]
    want = [f(p) for p in parts]
    assert_same(got, want, rtol=1e-12, atol=1e-12)
    weight = torch.randn_like(got.values)
    (grad,) = torch.autograd.grad((got.values * weight).sum(), leaf)
    loss = sum((w * o).sum() for w, o in zip(weight.split(list(x.lengths)), want, strict=True))
    grads = torch.autograd.grad(loss, parts, allow_unused=True)
    want_grad = torch.cat(
        [torch.zeros_like(p) if g is None else g for g, p in zip(grads, parts, strict=True)]
    )
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("kind", list(MASKS))
def test_masks_run_on_the_kernels_with_each_samples_mask(kind, rank, monkeypatch):
    # the materialized mask (masks built from positions stay lazy by default: their own
    # paths are tested in test_map_lazy_masks.py)
    monkeypatch.setattr(_lazy_pairs, "ENABLED", False)
    calls = []
    real = _attention_masked.attention_with_mask
    monkeypatch.setattr(
        _attention_masked, "attention_with_mask", lambda *a: calls.append(1) or real(*a)
    )
    f = _attend(kind, rank)
    x = _x()
    report = raggedfn.map_report(f, x)
    assert report.attention == {"fused with a mask": 1}
    assert report.fully_batched
    assert calls
    _check_loop(f, x)
    _check_loop(f, _x(WITH_EMPTY))


@pytest.mark.parametrize("kind", ["causal arange", "additive causal", "data", "per head"])
def test_large_batches_of_light_samples_take_length_buckets_with_the_mask(kind, monkeypatch):
    monkeypatch.setattr(_attention_masked, "LOOP_MAX_BATCH", 2)
    monkeypatch.setattr(_lazy_pairs, "ENABLED", False)  # the materialized mask
    calls = []
    real = _attention_masked._buckets
    monkeypatch.setattr(_attention_masked, "_buckets", lambda *a: calls.append(1) or real(*a))
    f = _attend(kind)
    _check_loop(f, _x((5, 9, 3, 1, 7, 0, 9, 9, 2)))
    assert calls


def test_pair_formulation_is_reported_and_warns_when_slower_than_padding(monkeypatch):
    monkeypatch.setattr(_rules_attention, "USE_RAGGED_ATTENTION", False)
    f = _attend("sliding window")
    x = _x()
    with pytest.warns(RaggedPerformanceWarning, match="pair formulation"):
        raggedfn.map(f, x)
    report = raggedfn.map_report(f, x)  # (which lists, and does not warn)
    assert report.attention == {"pair formulation": 1}
    assert report.fully_batched
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        _check_loop(f, x)
    # one long sample among many short ones: padding would cost more than the pairs
    skewed = _x((20,) + (1,) * 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RaggedPerformanceWarning)
        raggedfn.map(f, skewed)


def test_plain_attention_is_reported_fused():
    def f(t):
        h = t.transpose(0, 1)[None]
        return F.scaled_dot_product_attention(h, h, h, is_causal=True)[0].transpose(0, 1)

    assert raggedfn.map_report(f, _x()).attention == {"fused": 1}


def _dropped(p=0.5):
    def f(t):
        h = t.transpose(0, 1)[None]
        return F.scaled_dot_product_attention(h, h, h, dropout_p=p)[0].transpose(0, 1)

    return f


def test_dropout_runs_batched_with_the_loops_draws_in_sample_order():
    f = _dropped()
    x = _x()
    report = raggedfn.map_report(f, x)
    assert report.fully_batched and report.attention == {"fused": 1}
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = raggedfn.map(f, x)
        torch.manual_seed(seed)
        want = [f(s) for s in samples(x)]  # one call per sample, in sample order
        assert_same(got, want, rtol=0, atol=0)


def test_dropout_draws_independently_per_sample_and_keeps_the_expectation():
    sample = torch.randn(4, H, D, dtype=torch.float64)
    x = raggedfn.from_list([sample] * 6)  # equal samples: only the draws differ
    f = _dropped(0.3)
    out = raggedfn.map(f, x).values.view(6, 4, H, D)
    assert all(not torch.equal(out[0], out[b]) for b in range(1, 6))
    # E[dropout(P)] = P: the mean over many draws approaches the output without dropout
    mean = torch.stack([raggedfn.map(f, x).values for _ in range(300)]).mean(0)
    want = _dropped(0.0)(sample).repeat(6, 1, 1)
    assert (mean - want).abs().mean() < 0.05 * want.abs().mean()
    assert (mean - want).abs().mean() > 0  # and it did drop


def test_dropout_on_the_probabilities_in_eager_attention_is_batched_per_element():
    def f(t):
        h = t.transpose(0, 1)  # [H, N, D]
        probs = torch.softmax(h @ h.transpose(-1, -2), -1)
        return (F.dropout(probs, 0.5, training=True) @ h).transpose(0, 1)

    x = _x()
    report = raggedfn.map_report(f, x)
    assert report.fully_batched
    torch.manual_seed(0)
    out = raggedfn.map(f, x)
    no_drop = [
        (
            torch.softmax(s.transpose(0, 1) @ s.transpose(0, 1).transpose(-1, -2), -1)
            @ s.transpose(0, 1)
        ).transpose(0, 1)
        for s in samples(x)
    ]
    assert not torch.allclose(out.values, torch.cat(no_drop))


@pytest.mark.parametrize("randomness", ["same", "error"])
def test_dropout_under_same_or_error_raises(randomness):
    with pytest.raises(RaggedError, match="randomness"):
        raggedfn.map(_dropped(), _x(), randomness=randomness)


@pytest.mark.parametrize("randomness", ["same", "error"])
def test_attention_without_dropout_is_no_random_op(randomness):
    f = _attend("causal tril")
    got = raggedfn.map(f, _x(), randomness=randomness)
    assert_same(got, [f(s) for s in samples(_x())], rtol=1e-12, atol=1e-12)


def test_buckets_give_no_fully_masked_padding_rows(monkeypatch):
    """A padded query row of a bucket attends to its sample's keys: a fully masked row
    would be NaN on some kernels, and NaN reaches the keys' gradients."""
    monkeypatch.setattr(_attention_masked, "LOOP_MAX_BATCH", 2)
    boxes = []
    real = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        boxes.append(attn_mask)
        return real(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(_attention_masked.F, "scaled_dot_product_attention", spy)
    x = _x((5, 9, 3, 1, 7, 9, 2))
    _attention_masked.attention_with_mask(
        *(raggedfn.from_list(samples(x)),) * 3,
        raggedfn.from_list(
            [MASKS["sliding window"](s, s.shape[0])[..., None] for s in samples(x)],
            ragged_dims=(1, 2),
        ),
        False,
        None,
        0.0,
        4,
    )
    assert boxes and all(box.any(-1).all() for box in boxes)


def test_dropout_on_the_pair_formulation_draws_per_pair(monkeypatch):
    monkeypatch.setattr(_rules_attention, "USE_RAGGED_ATTENTION", False)
    sample = torch.randn(4, H, D, dtype=torch.float64)
    x = raggedfn.from_list([sample] * 4)
    f = _dropped(0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        assert raggedfn.map_report(f, x).attention == {"pair formulation": 1}
        out = raggedfn.map(f, x).values.view(4, 4, H, D)
        assert all(not torch.equal(out[0], out[b]) for b in range(1, 4))
        mean = torch.stack([raggedfn.map(f, x).values for _ in range(300)]).mean(0)
    want = _dropped(0.0)(sample).repeat(4, 1, 1)
    assert 0 < (mean - want).abs().mean() < 0.05 * want.abs().mean()


@pytest.mark.parametrize("convert", ["type_as", "to"])
def test_shared_constants_converted_to_a_samples_dtype_stay_shared(convert):
    def f(t):
        k = torch.tensor(3)
        k = k.type_as(t) if convert == "type_as" else k.to(t)
        return t * k + torch.tensor([1.0, 2.0]).type_as(t)[None, :, None]

    x = _x()
    report = raggedfn.map_report(f, x)
    assert report.fully_batched, report.fallback
    assert_same(report.output, [f(s) for s in samples(x)], rtol=0, atol=0)
