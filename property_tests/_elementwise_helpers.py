"""Shared helpers of the elementwise/shape/nn/broadcast property tests.

``check`` compares a raggedfn op with a per-sample loop in values and in
gradients (of a squared-sum loss, w.r.t. every Ragged ``values`` and every dense
tensor argument that requires grad). Per-sample references use leaf tensors cut
out by ``reference.samples`` and packed back with ``reference.pack_like``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from property_tests.reference import assert_same, pack_like, samples
from raggedfn import Layout, Ragged
from raggedfn._layout import Axis


@dataclass
class PerSample:
    """A dense ``[B, ...]`` argument whose row ``i`` goes to sample ``i`` in the loop."""

    tensor: Tensor


def pack(tensors: list[Tensor], layout: Layout, dense_shape: tuple[int, ...]) -> Ragged:
    """Pack logical per-sample tensors with ``layout`` by hand (no raggedfn conversions)."""
    to_physical = layout.logical_to_physical()
    num_ragged = layout.num_ragged
    rows, parts = [], []
    for t in tensors:
        physical = t.permute(*to_physical)
        rows.append(list(physical.shape[:num_ragged]))
        parts.append(physical.reshape(-1, *dense_shape))
    sizes = torch.tensor(rows, dtype=torch.int64).reshape(len(tensors), num_ragged)
    lengths = [int(torch.tensor(r).prod()) if r else 1 for r in rows]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return Ragged(torch.cat(parts), offsets, sizes, layout)


@st.composite
def same_positions_layout(draw: Any, layout: Layout) -> Layout:
    """A layout with the ragged axes at the same positions, storage numbered at random."""
    ragged_pos = [p for p, a in enumerate(layout.axes) if a.ragged]
    dense_pos = [p for p, a in enumerate(layout.axes) if not a.ragged]
    ks = draw(st.permutations(list(range(len(ragged_pos)))))
    js = draw(st.permutations(list(range(len(dense_pos)))))
    axes: list[Axis] = [Axis(False, 0)] * layout.rank
    for p, k in zip(ragged_pos, ks, strict=True):
        axes[p] = Axis(True, k)
    for p, j in zip(dense_pos, js, strict=True):
        axes[p] = Axis(False, j)
    return Layout(tuple(axes))


def relayout(x: Ragged, layout: Layout, seed: int | None = None) -> Ragged:
    """``x``'s samples (or, given a seed, random data of their shapes) stored with ``layout``.

    The result's values are a fresh leaf that requires grad when ``x``'s do.
    """
    logical = [s.detach() for s in samples(x)]
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        logical = [
            torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
            if s.is_floating_point()
            else s.clone()
            for s in logical
        ]
    dense_shape = [0] * layout.num_dense
    shape = x.shape[1:]
    for p, a in enumerate(layout.axes):
        if not a.ragged:
            dense_shape[a.index] = shape[p]
    if not logical:
        empty = x.values.detach().new_zeros((0, *dense_shape))
        out = Ragged(empty, x.offsets, x.sizes.new_zeros(0, layout.num_ragged), layout)
    else:
        out = pack(logical, layout, tuple(dense_shape))
    if x.values.requires_grad:
        out.values.requires_grad_(True)
    return out


def _leaves(arg: Any) -> list[Tensor]:
    return [s.detach().requires_grad_(arg.values.requires_grad) for s in samples(arg)]


def _grad(loss: Tensor, inputs: list[Tensor]) -> list[Tensor]:
    if not inputs:
        return []
    if not loss.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]


def check(
    ragged_fn: Callable[..., Any],
    sample_fn: Callable[..., Tensor],
    *args: Any,
    grad: bool = True,
    **tol: Any,
) -> Any:
    """``ragged_fn(*args)`` equals ``[sample_fn(*args_i)]`` in values and gradients.

    Ragged args become their samples, ``PerSample`` args their rows, other args
    are shared. Inputs must not be modified (``_version`` unchanged).
    """
    versions = [a.values._version for a in args if isinstance(a, Ragged)]
    call_args = [a.tensor if isinstance(a, PerSample) else a for a in args]
    out = ragged_fn(*call_args)
    assert versions == [a.values._version for a in args if isinstance(a, Ragged)]
    batch = next(a.batch_size for a in args if isinstance(a, Ragged))
    per_arg = [_leaves(a) if isinstance(a, Ragged) else None for a in args]
    expected = []
    for i in range(batch):
        sample_args = []
        for a, p in zip(args, per_arg, strict=True):
            if p is not None:
                sample_args.append(p[i])
            elif isinstance(a, PerSample):
                sample_args.append(a.tensor[i])
            else:
                sample_args.append(a)
        expected.append(sample_fn(*sample_args))
    assert_same(out, [e.detach() for e in expected], **tol)
    if not grad:
        return out
    raggeds = [(a, p) for a, p in zip(args, per_arg, strict=True) if p is not None]
    dense = [
        a.tensor if isinstance(a, PerSample) else a
        for a in args
        if isinstance(a, (Tensor, PerSample))
        and (a.tensor if isinstance(a, PerSample) else a).requires_grad
    ]
    wanted = [a.values for a, _ in raggeds if a.values.requires_grad]
    got_values = out.values if isinstance(out, Ragged) else out
    got = _grad((got_values.to(torch.float64) ** 2).sum(), wanted + dense)
    ref_loss = sum(
        ((e.to(torch.float64) ** 2).sum() for e in expected), torch.zeros((), dtype=torch.float64)
    )
    leaves = [leaf for a, p in raggeds if a.values.requires_grad for leaf in p]
    ref = _grad(ref_loss, leaves + dense)
    ref_values, ref_dense = ref[: len(leaves)], ref[len(leaves) :]
    start = 0
    for a, p in raggeds:
        if not a.values.requires_grad:
            continue
        g = ref_values[start : start + len(p)]
        start += len(p)
        torch.testing.assert_close(got.pop(0), pack_like(g, a), **tol)
    out_numel = got_values.numel()
    for g, r in zip(got, ref_dense, strict=True):
        torch.testing.assert_close(g, r, **(tol or _summed(g, out_numel)))
    return out


# torch.testing.assert_close's defaults (rtol, atol) per dtype
_DEFAULT_TOL = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def _summed(grad: Tensor, out_numel: int) -> dict[str, float]:
    """The tolerance of a dense (shared) input's gradient: each entry sums the terms of
    every output element that reads it, over all samples at once, where the loop sums
    per sample and then over samples. Rounding of a sum of ``n`` terms in another order
    differs by up to about ``n * eps`` relative: a float32 layer_norm weight gradient of
    a few dozen rows differed by 32 ulp (2.7e-6 relative) in one hypothesis example,
    beyond the default 1.3e-6."""
    if grad.dtype not in _DEFAULT_TOL:
        return {}
    rtol, atol = _DEFAULT_TOL[grad.dtype]
    terms = max(out_numel // max(grad.numel(), 1), 1)
    return {"rtol": max(rtol, torch.finfo(grad.dtype).eps * terms), "atol": atol}
