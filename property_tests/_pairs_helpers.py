"""Values-and-gradients comparison against per-sample loops (pairs, attention, select tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from property_tests.reference import assert_same, pack_like, samples
from raggedfn import Ragged, from_lengths
from raggedfn.ops import _attention, _bucket, _products


def _floating(x: Any) -> bool:
    return isinstance(x, Ragged) and x.values.is_floating_point()


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


@contextmanager
def tight_buckets() -> Iterator[None]:
    """One bucket per distinct size (no slack, no minimum work); attention and products
    bucketed too (not their per-sample paths)."""
    saved = (
        _bucket.SLACK,
        _bucket.MIN_WORK,
        _attention.LOOP_MAX_BATCH,
        _products.PER_SAMPLE_MAX_BATCH,
        _products.PER_SAMPLE_MIN_WORK,
    )
    _bucket.SLACK, _bucket.MIN_WORK = 1.0, 0
    _attention.LOOP_MAX_BATCH = _products.PER_SAMPLE_MAX_BATCH = -1
    _products.PER_SAMPLE_MIN_WORK = float("inf")
    try:
        yield
    finally:
        (
            _bucket.SLACK,
            _bucket.MIN_WORK,
            _attention.LOOP_MAX_BATCH,
            _products.PER_SAMPLE_MAX_BATCH,
            _products.PER_SAMPLE_MIN_WORK,
        ) = saved


def check_against_loop(
    op: Callable[..., Any], ref: Callable[..., Any], *inputs: Any, **tolerances: Any
) -> None:
    """``op(*inputs)`` equals ``[ref(*sample_i)]`` in values and in gradients.

    Runs twice: with the default bucket plan (small samples share one padded
    bucket) and with one bucket per distinct size.
    """
    _check(op, ref, *inputs, **tolerances)
    with tight_buckets():
        _check(op, ref, *inputs, **tolerances)


def _check(
    op: Callable[..., Any],
    ref: Callable[..., Any],
    *inputs: Any,
    grad_atol: float | None = None,
    **tolerances: Any,
) -> None:
    """One comparison; ``grad_atol``: the gradients' own absolute tolerance where the
    outputs' does not bound them (attention's q and k gradients carry ``scale |k|``).

    Gradients are taken w.r.t. the packed values of every floating ``Ragged``
    input on the raggedfn side and w.r.t. independent per-sample leaf tensors on
    the reference side (packed with ``pack_like``), for a random linear loss.
    """
    ins = [
        Ragged(x.values.detach().requires_grad_(True), x.offsets, x.sizes, x.layout)
        if _floating(x)
        else x
        for x in inputs
    ]
    batch = next(x.batch_size for x in ins if isinstance(x, Ragged))
    per_sample = [
        [s.detach().requires_grad_(True) for s in samples(x)]
        if _floating(x)
        else samples(x)
        if isinstance(x, Ragged)
        else None
        for x in ins
    ]
    outs = _as_tuple(op(*ins))
    expected = [
        _as_tuple(
            ref(*(p[i] if p is not None else x for p, x in zip(per_sample, ins, strict=True)))
        )
        for i in range(batch)
    ]
    gen = torch.Generator().manual_seed(1234)
    loss_r: Tensor | float = 0.0
    loss_e: Tensor | float = 0.0
    for n, out in enumerate(outs):
        wanted = [e[n] for e in expected]
        assert_same(out, [w.detach() for w in wanted], **tolerances)
        values = out.values if isinstance(out, Ragged) else out
        if not values.is_floating_point():
            continue
        weights = [
            torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w.dtype) for w in wanted
        ]
        if isinstance(out, Ragged):
            packed = _pack(weights, out)
        elif weights:
            packed = torch.stack(weights)
        else:
            packed = torch.zeros_like(values)
        loss_r = loss_r + (values * packed).sum()
        loss_e = loss_e + sum(((w * e).sum() for w, e in zip(weights, wanted, strict=True)), 0.0)
    floating = [n for n, x in enumerate(ins) if _floating(x)]
    if not floating or not isinstance(loss_r, Tensor) or not loss_r.requires_grad:
        return
    got = torch.autograd.grad(
        loss_r, [ins[n].values for n in floating], allow_unused=True, materialize_grads=True
    )
    leaves = [leaf for n in floating for leaf in per_sample[n]]
    if leaves and isinstance(loss_e, Tensor) and loss_e.requires_grad:
        flat = torch.autograd.grad(loss_e, leaves, allow_unused=True, materialize_grads=True)
    else:
        flat = [torch.zeros_like(leaf) for leaf in leaves]
    start = 0
    grad_tolerances = dict(tolerances)
    if grad_atol is not None:
        grad_tolerances["atol"] = grad_atol
    for n, g in zip(floating, got, strict=True):
        count = len(per_sample[n])
        want = _pack(list(flat[start : start + count]), ins[n])
        start += count
        torch.testing.assert_close(
            g, want, msg=lambda m, n=n: f"grad of input {n}: {m}", **grad_tolerances
        )


def _pack(tensors: list[Tensor], x: Ragged) -> Tensor:
    """``pack_like`` that also handles dense axes of size 0 (row counts from ``x``)."""
    if x.values.numel():
        return pack_like(tensors, x)
    return torch.zeros_like(x.values)


@st.composite
def tokens_for(draw: Any, batch: int, feature_shape: tuple[int, ...], dtype: torch.dtype) -> Ragged:
    """A ``(B, M*, *feature_shape)`` token batch with ``batch`` samples (empty ones included)."""
    lengths = draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn((sum(lengths), *feature_shape), generator=gen, dtype=torch.float64)
    return from_lengths(values.to(dtype), torch.tensor(lengths, dtype=torch.int64))


def like(
    x: Ragged, seed: int, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None
) -> Ragged:
    """Random values with the partition and layout of ``x`` (optionally other dense sizes)."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(x.values.shape) if shape is None else (x.values.shape[0], *shape)
    values = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype or x.dtype)
    return Ragged(values, x.offsets, x.sizes, x.layout)
