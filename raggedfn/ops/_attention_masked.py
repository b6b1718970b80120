"""Token attention with a mask per (query, key) pair, or with dropout, on torch's kernels.

``raggedfn.map`` runs a per-sample ``scaled_dot_product_attention`` call that was given
an ``attn_mask`` (transformers builds one from positions for causal decoders without a
cache, sliding windows and local layers) or a ``dropout_p`` through
:func:`attention_with_mask`. Small batches (and every call with dropout) make the call
the per-sample loop makes, with the same rank (a 4-d call takes torch's fused kernel, a
3-d one the math kernel), on strided views of the packed values and on the sample's
slice of the mask; larger batches of light samples run length buckets (``_bucket.py``),
each one padded SDPA call with the mask scattered into its box.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._errors import fail
from .._ragged import Ragged
from . import _bucket
from ._attention import LOOP_MAX_BATCH, VIEWS_MIN_WORK, head_views
from ._attention_checks import check_arguments

__all__: list[str] = []


def _per_sample(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    mask: Ragged | None,
    sizes: dict[str, list[int]],
    causal: bool,
    scale: float | None,
    dropout_p: float,
    rank: int,
) -> Ragged:
    n_list, m_list = sizes["n"], sizes["m"]
    masks: list[Tensor | None] = [None] * q.batch_size
    if mask is not None:
        width = mask.values.shape[1]
        parts = mask.values.split([n * m for n, m in zip(n_list, m_list, strict=True)])
        for b, part in enumerate(parts):
            one = part.view(n_list[b], m_list[b], width).permute(2, 0, 1)  # [h, N, M]
            masks[b] = one.contiguous() if width > 1 else one
    return per_sample_calls(q, k, v, masks, [causal] * q.batch_size, sizes, scale, dropout_p, rank)


def per_sample_calls(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    masks: list[Tensor | None],
    causal: list[bool],
    sizes: dict[str, list[int]],
    scale: float | None,
    dropout_p: float,
    rank: int,
) -> Ragged:
    """One SDPA call per sample on views of the packed values, sample ``b`` with its own
    ``masks[b]`` (``[h, N_b, M_b]``, ``h`` 1 or ``H``; None: no mask) and ``causal[b]``,
    at the rank the loop calls it."""
    n_list, m_list = sizes["n"], sizes["m"]
    qs, ks, vs = (head_views(t, c, batch=False) for t, c in ((q, n_list), (k, m_list), (v, m_list)))
    outs = []
    for b, (query, key, value) in enumerate(zip(qs, ks, vs, strict=True)):
        attn_mask = masks[b]
        if rank == 4:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            attn_mask = attn_mask.unsqueeze(0) if attn_mask is not None else None
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=causal[b],
            scale=scale,
        )
        # squeeze, not out[0]: a select's backward zero-fills a whole gradient per sample
        outs.append((out.squeeze(0) if rank == 4 else out).transpose(0, 1))  # [N, H, Dv]
    values = torch.cat(outs).permute(q.layout.logical_to_physical()).contiguous()
    return Ragged(values, q.offsets, q.sizes, q.layout)


def _buckets(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    mask: Ragged,
    sizes: dict[str, list[int]],
    causal: bool,
    scale: float | None,
) -> Ragged:
    """Length buckets, each one SDPA call on its padded box. A padded key never takes part;
    a padded query row attends to its sample's keys (no fully masked padding rows, whose
    NaN would reach the gradients) and is dropped by ``unpad``."""
    buckets = _bucket.plan(sizes, q.batch_size)
    qs, ks, vs = (
        _bucket.pad(q, ["n"], buckets),
        _bucket.pad(k, ["m"], buckets),
        _bucket.pad(v, ["m"], buckets),
    )
    boxes = _bucket.pad(mask, ["n", "m"], buckets)  # [G, N, M, h]
    device = q.device
    outs = []
    for g, bucket in enumerate(buckets):
        n, m = bucket.extents["n"], bucket.extents["m"]
        rows = torch.tensor([sizes["n"][b] for b in bucket.samples], device=device)
        cols = torch.tensor([sizes["m"][b] for b in bucket.samples], device=device)
        key_in = torch.arange(m, device=device) < cols[:, None]  # [G, M]
        row_out = torch.arange(n, device=device) >= rows[:, None]  # [G, N]
        box = boxes[g].permute(0, 3, 1, 2)  # [G, h, N, M]
        key_in, row_out = key_in[:, None, None, :], row_out[:, None, :, None]
        if box.dtype == torch.bool:
            box = box | (row_out & key_in)
        else:
            box = torch.where(key_in, box, float("-inf"))
        if causal:  # the loop's is_causal on each sample: top-left aligned, inside the box
            lower = torch.ones(n, m, dtype=torch.bool, device=device).tril()
            box = box & lower if box.dtype == torch.bool else box.masked_fill(~lower, -math.inf)
        query, key, value = (t.movedim(-2, -3).contiguous() for t in (qs[g], ks[g], vs[g]))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=box, scale=scale)
        outs.append(out.movedim(-3, -2))  # [G, N, H, Dv]
    return _bucket.unpad(outs, q.layout, ["n"], buckets, sizes, q.batch_size)


def attention_with_mask(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    mask: Ragged | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    rank: int,
) -> Ragged:
    """``scaled_dot_product_attention`` of each sample alone with its mask, as the loop.

    Args:
        q: ``(B, N*, H, Dh)`` queries.
        k: ``(B, M*, H, Dh)`` keys.
        v: ``(B, M*, H, Dv)`` values, the partition of ``k``.
        mask: a pair state ``(B, N*, M*, h)`` with sizes ``(N_i, M_i)`` and ``h`` 1
            (shared by the heads) or ``H``; boolean (True takes part) or additive, as
            SDPA's ``attn_mask``. None: no mask.
        causal: SDPA's ``is_causal``.
        scale: SDPA's ``scale``.
        dropout_p: SDPA's ``dropout_p``: each sample draws its own dropout pattern (one
            call per sample, in sample order).
        rank: 4 for ``[1, H, N, D]`` calls (torch's fused kernels), 3 for ``[H, N, D]``
            (the math kernel), as the per-sample function called it.

    Returns:
        ``(B, N*, H, Dv)`` with the partition and layout of ``q``.
    """
    q, k, v, sizes = check_arguments(q, k, v, None, None, causal)
    if q.num_ragged != 1:
        raise fail("attention", "a mask per (query, key) pair needs one ragged axis")
    if mask is not None and (
        mask.num_ragged != 2
        or mask.layout.rank != 3
        or mask.values.shape[1] not in (1, q.shape[-2])
        or mask.sizes.shape != (q.batch_size, 2)
    ):
        raise fail(
            "attention", f"the mask must be a pair state (B, N*, M*, 1 or H), got {mask.shape}"
        )
    if q.batch_size == 0:
        shape = (0, *q.values.shape[1:-1], v.values.shape[-1])
        return q.with_values(q.values.new_empty(shape))
    pairs = sum(n * m for n, m in zip(sizes["n"], sizes["m"], strict=True))
    per_pair = math.prod(q.values.shape[1:]) + math.prod(v.values.shape[1:])
    if (
        mask is None
        or dropout_p
        or q.batch_size <= LOOP_MAX_BATCH
        or per_pair * pairs >= VIEWS_MIN_WORK * q.batch_size
    ):
        return _per_sample(q, k, v, mask, sizes, causal, scale, dropout_p, rank)
    # a sample's 3-d call runs the math kernel: so do the buckets then (the loop's roundings)
    kernel = sdpa_kernel(SDPBackend.MATH) if rank != 4 else contextlib.nullcontext()
    with kernel:
        return _buckets(q, k, v, mask, sizes, causal, scale)


def attention_with_masks(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    masks: list[Tensor | None],
    causal: list[bool],
    scale: float | None,
    dropout_p: float,
    rank: int,
) -> Ragged:
    """``scaled_dot_product_attention`` of each sample alone, sample ``b`` with its own
    boolean mask ``masks[b]`` (``[h, N_b, M_b]``, ``h`` 1 or ``H``; None: none) and
    ``is_causal=causal[b]`` (``raggedfn.map``'s masks built from positions, see
    ``_map/rules/_lazy_pairs.py``). Arguments otherwise as :func:`attention_with_mask`."""
    q, k, v, sizes = check_arguments(q, k, v, None, None, False)
    if len(masks) != q.batch_size or len(causal) != q.batch_size:
        raise fail("attention", f"one mask and causal flag per sample, got {len(masks)}")
    return per_sample_calls(q, k, v, masks, causal, sizes, scale, dropout_p, rank)
