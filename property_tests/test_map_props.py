"""Random per-sample programs: ``raggedfn.map(f, x)`` equals the per-sample loop.

A program is a short list of steps drawn from the ops ``map`` has batching rules
for (pointwise, linear with shared weights, norms, softmax and reductions over
the ragged axis, attention, concatenation, transposes, pair states made by
broadcasting). It runs on samples of ``raggeds()`` inputs with one or two
ragged axes, in any dim order. Values and gradients (w.r.t. the packed input
values and the shared parameters) must equal the per-sample loop's, and
``strict=True`` must never need a per-sample loop.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import assert_same, loop, samples
from property_tests.strategies import raggeds

C = 3  # feature size of every state

# token steps: (N, C) -> (N', C); pair steps: (N, M, C) -> (N, M, C)
TOKEN_STEPS = (
    "relu",
    "tanh_affine",
    "square",
    "gelu",
    "linear",
    "layer_norm",
    "rms_norm",
    "softmax_tokens",
    "log_softmax_features",
    "add_mean",
    "add_logsumexp",
    "attention",
    "attention_causal",
    "attention_by_hand",
    "cat_features",
    "cat_row",
    "gram",
    "pair_outer_softmax",
    "cumsum",
    "transpose_roundtrip",
)
PAIR_STEPS = ("relu", "linear", "layer_norm", "softmax_cols", "transpose_sum", "square")


def _token_step(name: str, h: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    if name == "relu":
        return h.relu()
    if name == "tanh_affine":
        return torch.tanh(h * 0.5 + 1)
    if name == "square":
        return h * h - h
    if name == "gelu":
        return F.gelu(h)
    if name == "linear":
        return F.linear(h, p["w"], p["b"])
    if name == "layer_norm":
        return F.layer_norm(h, (C,), p["g"], p["b"])
    if name == "rms_norm":
        return F.rms_norm(h, (C,), p["g"])
    if name == "softmax_tokens":
        return h.softmax(0) * h.shape[0]
    if name == "log_softmax_features":
        return F.log_softmax(h, -1)
    if name == "add_mean":
        return h - h.mean(0, keepdim=True)
    if name == "add_logsumexp":
        return h - h.logsumexp(0, keepdim=True)
    if name == "attention":
        return F.scaled_dot_product_attention(h[None], h[None], h[None])[0]
    if name == "attention_causal":
        return F.scaled_dot_product_attention(h[None], h[None], h[None], is_causal=True)[0]
    if name == "attention_by_hand":
        return torch.softmax(h @ h.T / math.sqrt(C), -1) @ h
    if name == "cat_features":
        return F.linear(torch.cat([h, h.sin()], -1), p["w2"])
    if name == "cat_row":
        return torch.cat([p["row"][None], h], 0)
    if name == "gram":
        return h @ (h.T @ h) / 10
    if name == "pair_outer_softmax":
        pair = h[:, None, :] * h[None, :, :]
        return (pair.softmax(1) * h[None, :, :]).sum(1)
    if name == "cumsum":
        return h.cumsum(0) / 4
    if name == "transpose_roundtrip":
        return (h.T * p["g"][:, None]).T
    raise AssertionError(name)


def _pair_step(name: str, q: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    if name == "relu":
        return q.relu()
    if name == "linear":
        return F.linear(q, p["w"], p["b"])
    if name == "layer_norm":
        return F.layer_norm(q, (C,))
    if name == "softmax_cols":
        return q.softmax(1)
    if name == "transpose_sum":
        return q + q.mean(0, keepdim=True)
    if name == "square":
        return q * q
    raise AssertionError(name)


@functools.cache
def program(positions: tuple[int, ...], pair_steps: tuple[str, ...], steps: tuple[str, ...]):
    """One function object per description, so equal programs share a trace."""

    def f(x: torch.Tensor, p: dict[str, torch.Tensor]):
        # bring the ragged axes to the front: (N, C) or (N, M, C)
        dense = [a for a in range(x.ndim) if a not in positions]
        h = x.permute(*positions, *dense)
        if len(positions) == 2:
            for name in pair_steps:
                h = _pair_step(name, h, p)
            h = h.sum(0)  # (M, C)
        for name in steps:
            h = _token_step(name, h, p)
        return {"tokens": h, "pooled": h.sum(0), "transposed": h.T * 2}

    return f


def params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) / 2).to(dtype)

    out = {"w": r(C, C), "b": r(C), "g": r(C) + 1, "w2": r(C, 2 * C), "row": r(C)}
    return {k: v.requires_grad_() for k, v in out.items()}


@st.composite
def cases(draw, dtype):
    x = draw(
        raggeds(
            num_ragged=st.sampled_from([1, 2]),
            feature_shape=(C,),
            dtype=dtype,
            requires_grad=True,
            max_batch=4,
            max_size=4,
        )
    )
    positions = tuple(p for p, a in enumerate(x.layout.axes) if a.ragged)
    pair_steps = ()
    if len(positions) == 2:
        pair_steps = tuple(draw(st.lists(st.sampled_from(PAIR_STEPS), max_size=2)))
    steps = tuple(draw(st.lists(st.sampled_from(TOKEN_STEPS), min_size=1, max_size=3)))
    return x, program(positions, pair_steps, steps)


def _loss(out) -> torch.Tensor:
    tokens = out["tokens"]
    values = tokens.values if isinstance(tokens, raggedfn.Ragged) else tokens
    return (values * values).sum() + out["pooled"].sin().sum()


def _check(x, f, dtype):
    p = params(dtype)
    out = raggedfn.map(f, x, p, in_dims=(0, None), strict=True)
    expected = loop(f, x, p)
    assert_same(out["tokens"], [e["tokens"] for e in expected])
    assert_same(out["pooled"], [e["pooled"] for e in expected])
    assert_same(out["transposed"], [e["transposed"] for e in expected])
    leaves = [x.values, *p.values()]
    got = torch.autograd.grad(_loss(out), leaves, allow_unused=True)
    ref_loss = sum((e["tokens"] * e["tokens"]).sum() + e["pooled"].sin().sum() for e in expected)
    if not expected:
        return
    want = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    got = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(got, leaves, strict=True)]
    want = [
        torch.zeros_like(leaf) if w is None else w for w, leaf in zip(want, leaves, strict=True)
    ]
    if dtype == torch.float64:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        return
    # float32 gradients through a few ops differ from the loop's by summation order
    # alone (segment sums vs per-sample sums). Judge both against the float64 loop:
    # map must be about as accurate as the float32 loop itself.
    exact = _float64_grads(x, f)
    eps = torch.finfo(torch.float32).eps
    for g, w, e in zip(got, want, exact, strict=True):
        if e.numel() == 0:
            continue
        map_error = (g.double() - e).abs().max()
        loop_error = (w.double() - e).abs().max()
        bound = 4 * loop_error + 4 * eps * e.abs().max()
        assert map_error <= bound, (float(map_error), float(loop_error), float(bound))


def _float64_grads(x, f) -> list[torch.Tensor]:
    values = x.values.detach().double().requires_grad_()
    p = params(torch.float64)
    expected = loop(f, x.with_values(values), p)
    ref_loss = sum((e["tokens"] * e["tokens"]).sum() + e["pooled"].sin().sum() for e in expected)
    leaves = [values, *p.values()]
    grads = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    return [
        torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)
    ]


@settings(deadline=None, max_examples=30)
@given(cases(torch.float64))
def test_random_programs_float64(case):
    x, f = case
    _check(x, f, torch.float64)


@settings(deadline=None, max_examples=15)
@given(cases(torch.float32))
def test_random_programs_float32(case):
    x, f = case
    _check(x, f, torch.float32)


def test_a_program_reaches_every_step():
    """Every step runs batched on a batch with an empty and a one-token sample."""
    x = raggedfn.from_list(
        [torch.randn(n, C, dtype=torch.float64) for n in (3, 0, 1, 4)]
    ).with_values(torch.randn(8, C, dtype=torch.float64).requires_grad_())
    for step in TOKEN_STEPS:
        _check(x, program((0,), (), (step,)), torch.float64)
    pairs = raggedfn.from_list(
        [torch.randn(n, n + 1, C, dtype=torch.float64) for n in (2, 0, 3)], ragged_dims=(1, 2)
    )
    pairs = pairs.with_values(pairs.values.clone().requires_grad_())
    for step in PAIR_STEPS:
        _check(pairs, program((0, 1), (step,), ("relu",)), torch.float64)
    assert samples(x)[1].shape == (0, C)
