"""Variable-length attention as a custom op pair, for compiled code.

``raggedfn::varlen_attention`` runs torch's fused CPU SDPA kernel once per
sample on packed ``[T, H, D]`` queries/keys/values and returns the output and the
per-row logsumexp; ``raggedfn::varlen_attention_backward`` hands both back to the
kernel's own backward. Unlike :func:`host_planned` (which recomputes the
forward in its backward), nothing is computed twice.

Used by ``raggedfn.attention`` under ``torch.compile`` for plain attention (one
ragged axis, no bias, no key padding, packed ``(B, N*, H, D)`` storage, CPU), and by
``map``'s attention rule there with a boolean per-sample mask shared by the heads
(transformers' packed-sequence mask); the eager path keeps its autograd-composable
implementation. Like every custom op,
it is opaque to ``torch.func`` transforms and to double backward inside
compiled code (those raise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._errors import fail
from ._forward import refuse_compiled


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _head_views(t: Tensor, lengths: list[int]) -> tuple[Tensor, ...]:
    """Each sample's ``[1, H, N_b, D]`` heads of packed ``[T, H, D]`` rows, by one
    ``split``: views where ``D`` is the unit-stride axis (torch's CPU kernels read strided
    heads in place, as eager ``raggedfn.attention`` calls them), else views of one
    head-major copy (the kernel is slower on, and rounds differently for, a strided
    ``D``)."""
    heads = t.transpose(0, 1)
    if heads.stride(-1) != 1:
        heads = heads.contiguous()
    return heads.unsqueeze(0).split(lengths, dim=2)


def _lengths(bounds: list[tuple[int, int, int, int]]) -> tuple[list[int], list[int]]:
    """Each sample's query and key lengths."""
    return [q1 - q0 for q0, q1, _, _ in bounds], [k1 - k0 for _, _, k0, k1 in bounds]


# the overloads themselves: no overload resolution per sample
_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_KERNEL_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _bounds(
    q_offsets: Tensor, k_offsets: Tensor, v_offsets: Tensor
) -> list[tuple[int, int, int, int]]:
    fn = "attention"
    if not torch.equal(k_offsets, v_offsets):
        raise fail(fn, "k and v must have the same partition (equal sizes per sample)")
    if q_offsets.shape != k_offsets.shape:
        raise fail(
            fn,
            f"q, k and v must have the same batch size, got {q_offsets.shape[0] - 1} and "
            f"{k_offsets.shape[0] - 1}",
        )
    starts, ends = q_offsets.tolist(), k_offsets.tolist()
    return [(starts[b], starts[b + 1], ends[b], ends[b + 1]) for b in range(len(starts) - 1)]


def _uniform(bounds: list[tuple[int, int, int, int]]) -> int:
    """``B`` when every sample has the same non-zero query and key lengths, else 0."""
    lengths = {(q1 - q0, k1 - k0) for q0, q1, k0, k1 in bounds}
    if len(lengths) != 1:
        return 0
    ((n, m),) = lengths
    return len(bounds) if n and m else 0


def _batched(t: Tensor, batch: int) -> Tensor:
    """Packed ``[B * N, H, D]`` rows of equal-length samples as contiguous ``[B, H, N, D]``."""
    return t.view(batch, -1, *t.shape[1:]).transpose(1, 2).contiguous()


def _unbatched(t: Tensor) -> Tensor:
    """``[B, H, N, D]`` back to packed ``[B * N, H, D]``."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[-1])


@torch.library.custom_op("raggedfn::varlen_attention", mutates_args=())
def _varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    v_offsets: Tensor,
    causal: bool,
    scale: float | None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    bounds = _bounds(q_offsets, k_offsets, v_offsets)
    masks = _masks(mask, bounds, q.dtype)
    batch = _uniform(bounds) if not any(m is not None for m in masks) else 0
    if batch:  # every sample has the same lengths: one batched kernel call on views
        o, logsumexp = _KERNEL(*(_batched(t, batch) for t in (q, k, v)), 0.0, causal, scale=scale)
        return _unbatched(o), _unbatched(logsumexp.unsqueeze(-1)).squeeze(-1)
    # per sample on views (one split per input), the outputs joined by one cat each:
    # no per-sample slicing, transposing or copying into preallocated outputs
    lengths_q, lengths_k = _lengths(bounds)
    qs, ks, vs = _head_views(q, lengths_q), _head_views(k, lengths_k), _head_views(v, lengths_k)
    heads, lse_dtype = q.shape[1], _lse_dtype(q.dtype)
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for query, key, value, m, n, keys in zip(qs, ks, vs, masks, lengths_q, lengths_k, strict=True):
        if n == 0:
            continue
        if keys == 0:  # no keys: zeros as torch's SDPA gives
            outs.append(q.new_zeros(n, heads, v.shape[2]))
            lses.append(q.new_full((n, heads), float("-inf"), dtype=lse_dtype))
            continue
        o, logsumexp = _KERNEL(query, key, value, 0.0, causal, attn_mask=m, scale=scale)
        outs.append(o.squeeze(0).transpose(0, 1))  # [N, H, Dv]
        lses.append(logsumexp.squeeze(0).transpose(0, 1))  # [N, H]
    if not outs:
        return q.new_zeros(0, heads, v.shape[2]), q.new_zeros(0, heads, dtype=lse_dtype)
    return torch.cat(outs), torch.cat(lses)


@_varlen.register_fake
def _varlen_fake(q: Tensor, k: Tensor, v: Tensor, *static: Any) -> tuple[Tensor, Tensor]:
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, q.new_empty(q.shape[0], q.shape[1], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("raggedfn::varlen_attention_backward", mutates_args=())
def _varlen_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    causal: bool,
    scale: float | None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    bounds = _bounds(q_offsets, k_offsets, k_offsets)
    masks = _masks(mask, bounds, q.dtype)
    batch = _uniform(bounds) if not any(m is not None for m in masks) else 0
    if batch:
        grads = _KERNEL_BACKWARD(
            *(_batched(t, batch) for t in (grad, q, k, v, out)),
            _batched(lse.unsqueeze(-1), batch).squeeze(-1),
            0.0,
            causal,
            scale=scale,
        )
        dq, dk, dv = (_unbatched(g) for g in grads)
        return dq, dk, dv
    lengths_q, lengths_k = _lengths(bounds)
    gs, qs, os = (_head_views(t, lengths_q) for t in (grad, q, out))
    ks, vs = _head_views(k, lengths_k), _head_views(v, lengths_k)
    # [1, H, N] views with the strides of the kernel's own logsumexp output
    lses = lse.t().unsqueeze(0).split(lengths_q, dim=2)
    dqs: list[Tensor] = []
    dks: list[Tensor] = []
    dvs: list[Tensor] = []
    for b, m in enumerate(masks):
        n, keys = lengths_q[b], lengths_k[b]
        if n == 0 or keys == 0:  # nothing attended: zero gradients for the rows there are
            dqs.append(q.new_zeros(n, *q.shape[1:]))
            dks.append(k.new_zeros(keys, *k.shape[1:]))
            dvs.append(v.new_zeros(keys, *v.shape[1:]))
            continue
        gq, gk, gv = _KERNEL_BACKWARD(
            gs[b], qs[b], ks[b], vs[b], os[b], lses[b], 0.0, causal, attn_mask=m, scale=scale
        )
        dqs.append(gq.squeeze(0).transpose(0, 1))
        dks.append(gk.squeeze(0).transpose(0, 1))
        dvs.append(gv.squeeze(0).transpose(0, 1))
    if not dqs:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return torch.cat(dqs), torch.cat(dks), torch.cat(dvs)


@_varlen_backward.register_fake
def _varlen_backward_fake(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, *saved: Any
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, q_offsets, k_offsets, _, causal, scale, *mask = inputs
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, output[0], output[1], q_offsets, k_offsets, *mask)


def _backward(ctx: Any, grad: Tensor, grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, q_offsets, k_offsets, *mask = ctx.saved_tensors
    dq, dk, dv = _varlen_backward(
        grad.contiguous(), q, k, v, out, lse, q_offsets, k_offsets, ctx.causal, ctx.scale, *mask
    )
    return dq, dk, dv, None, None, None, None, None, None


_varlen.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    v_offsets: Tensor,
    causal: bool = False,
    scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-sample SDPA on packed ``[T, H, D]`` tensors (sample ``b`` owns rows
    ``offsets[b]:offsets[b + 1]``); the output has the rows of ``q``. A sample with
    no keys gives zeros. ``mask``: boolean ``[P]``, each sample's ``[N_b, M_b]`` keep
    mask row-major, samples in order, shared by the heads; a sample whose mask is True
    everywhere runs without one, and a query whose keys are all masked gets zeros (as
    torch's SDPA). Refuses forward-mode AD (``RaggedError``): the custom op has no
    forward-mode rule."""
    refuse_compiled("attention", "attention runs as one opaque custom op there")
    return _varlen(q, k, v, q_offsets, k_offsets, v_offsets, causal, scale, mask)[0]


def _masks(
    mask: Tensor | None, bounds: list[tuple[int, int, int, int]], dtype: torch.dtype
) -> list[Tensor | None]:
    """Each sample's additive ``[N, M]`` mask for the fused kernel (0 kept, -inf masked),
    or None where nothing is masked."""
    if mask is None:
        return [None] * len(bounds)
    pairs = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in bounds)
    if mask.shape != (pairs,):
        raise fail("attention", f"the mask has {mask.numel()} entries for {pairs} pairs")
    out: list[Tensor | None] = []
    start = 0
    for q0, q1, k0, k1 in bounds:
        size = (q1 - q0) * (k1 - k0)
        keep = mask[start : start + size].reshape(q1 - q0, k1 - k0)
        start += size
        if bool(keep.all()):
            out.append(None)
        else:
            zeros = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
            out.append(zeros.masked_fill(~keep, float("-inf")))
    return out
