"""Batching rule for ``scaled_dot_product_attention`` over ragged query/key axes."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch
from torch import Tensor

from ... import _prims
from ..._errors import RaggedPerformanceWarning
from ..._index import host_all
from ..._layout import Layout
from ..._prims._forward import compiled_transform
from ..base._registry import rule
from ..base._sizes import Sz, Unsupported
from ..base._values import (
    Ctx,
    DenseB,
    RaggedB,
    align,
    axes_of,
    canonical_layout,
    canonicalize,
    struct_rows,
    take_rows,
)
from ._lazy_pairs import LazyPairB, classify
from ._linalg import logical
from ._reduce import segment

aten = torch.ops.aten

# Eager and compiled runs use raggedfn.attention (eagerly length-bucketed SDPA;
# compiled, one custom-op node: the fused kernel per sample with its own backward).
# Explicit masks, and compiled code under a torch.func transform (which the custom
# op cannot enter), use the packed (query, key) pair formulation below: no host sync,
# but every pair's product is held in memory.
USE_RAGGED_ATTENTION = True


def _tokens(x: RaggedB) -> Any:
    """A canonical ``[T, *lead, D]`` operand as the tokens ``(B, N*, H, D)`` of
    ``raggedfn.attention`` (``H``: the product of the per-sample leading axes)."""
    from ..._ragged import Ragged

    heads = math.prod(x.values.shape[1:-1])
    values = x.values.reshape(x.values.shape[0], heads, x.values.shape[-1])
    return Ragged(values, x.struct.offsets, x.struct.sizes, Layout.standard(1, 2))


def _via_attention(
    q: RaggedB, k: RaggedB, v: RaggedB, causal: bool, scale: Any, step: Any, rank: int
) -> Any:
    """``raggedfn.attention`` on the packed samples. ``rank``: of the per-sample call.
    torch's fused kernels take 4-d inputs only, so a sample's 3-d call runs the math
    kernel: so does the batched call then, which gives the loop's roundings."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ...ops._attention import attention

    tokens = _tokens
    if rank == 4 or torch.compiler.is_compiling():  # compiled: the varlen op's kernel
        out = attention(tokens(q), tokens(k), tokens(v), causal=causal, scale=scale)
    else:
        with sdpa_kernel(SDPBackend.MATH):
            out = attention(tokens(q), tokens(k), tokens(v), causal=causal, scale=scale)
    values = out.values.reshape((*q.values.shape[:-1], v.values.shape[-1]))
    return RaggedB(values.to(step.out.dtype), q.layout, q.sz, q.struct)


def _via_varlen_mask(
    ctx: Ctx,
    step: Any,
    q: RaggedB,
    k: RaggedB,
    v: RaggedB,
    mask: Any,
    pairs: Any,
    causal: bool,
    scale: Any,
) -> Any:
    """Compiled, a boolean mask shared by the heads: the varlen custom op with the mask,
    which runs a sample whose mask is True everywhere without it (transformers 5.25's
    packed-sequence mask; eager code drops such a mask before, see ``_masks_nothing``).
    None where the operands or the mask do not fit (the pair formulation runs)."""
    shape_q = logical(q)
    mask_shape = (*shape_q[:-2], shape_q[-2], logical(k)[-2])
    rank = len(mask_shape)
    layout = canonical_layout(rank, (rank - 2, rank - 1))
    keep = align(ctx, mask, mask_shape, layout, pairs)
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.ndim == 0:
        return None
    if any(d != 1 for d in keep.shape[1:]) or any(t.values.device.type != "cpu" for t in (q, k, v)):
        return None
    heads = [math.prod(t.values.shape[1:-1]) for t in (q, k, v)]
    if len(set(heads)) != 1 or q.values.shape[-1] != v.values.shape[-1]:
        return None
    if q.values.shape[-1] != k.values.shape[-1]:
        return None
    q3, k3, v3 = (
        t.values.reshape(t.values.shape[0], heads[0], t.values.shape[-1]) for t in (q, k, v)
    )
    flat = keep.reshape(keep.shape[0]).expand(pairs.total).contiguous()
    out = _prims.varlen_attention(
        q3, k3, v3, q.struct.offsets, k.struct.offsets, v.struct.offsets, causal, scale, flat
    )
    values = out.reshape((*q.values.shape[:-1], v.values.shape[-1]))
    return RaggedB(values.to(step.out.dtype), q.layout, q.sz, q.struct)


def _repeat_heads(ctx: Ctx, t: Any, shape_q: tuple[Any, ...], shape_t: tuple[Any, ...]) -> Any:
    """Grouped-query attention (``enable_gqa=True``): each key/value head serves
    ``Hq // Hk`` consecutive query heads, as torch repeats them (``repeat_interleave``)."""
    if len(shape_q) < 3 or len(shape_t) < 3:
        return t
    hq, hk = shape_q[-3], shape_t[-3]
    if isinstance(hq, Sz) or isinstance(hk, Sz):
        raise Unsupported("grouped-query attention over a ragged head axis")
    if hq == hk:
        return t
    if not isinstance(t, RaggedB) or hk == 0 or hq % hk:
        raise Unsupported("grouped-query attention with these head counts")
    t = canonicalize(ctx, t)
    axis = axes_of(t.layout)[len(shape_t) - 3]
    values = t.values.repeat_interleave(hq // hk, dim=1 + axis.index)
    return RaggedB(values, t.layout, t.sz, t.struct)


def _masks_nothing(mask: Any) -> bool:
    """A boolean mask that is True everywhere (eagerly, one host read per mask tensor:
    every layer given the same mask reads it once, see ``host_all``): attention without
    it is the same computation. transformers 5.25 builds one for every sequence given
    ``position_ids`` (its packed-sequence mask, which its eager code drops when no
    sequence restarts but keeps while traced); without it the call takes the
    length-bucketed kernels instead of the (query, key) pair formulation."""
    if torch.compiler.is_compiling():
        return False
    t = (
        mask.values
        if isinstance(mask, RaggedB)
        else mask.data
        if isinstance(mask, DenseB)
        else mask
    )
    if not isinstance(t, Tensor) or t.dtype != torch.bool:
        return False
    try:
        return host_all(t)
    except RuntimeError:  # a torch.vmap around map: its batched mask has no host value
        return False


PAIR_COST = 8.0  # a (query, key) pair of the pair formulation costs about this many
# padded pairs of a fused kernel (measured on CPU, fwd+bwd): the warning's threshold


def _note(ctx: Ctx, path: str) -> None:
    """Count the attention path a call took, for ``map_report``."""
    paths = getattr(ctx, "paths", None)
    if paths is not None:
        paths[path] = paths.get(path, 0) + 1


def _pair_mask(
    ctx: Ctx, mask: Any, shape_q: tuple[Any, ...], shape_k: tuple[Any, ...], pairs: Any
) -> Any:
    """The mask as a pair state ``(B, N*, M*, 1 or H)`` (``H``: the product of the
    per-sample query's leading axes, as ``_via_attention`` flattens them) for
    ``attention_with_mask``; None where it is not a tensor per (query, key) pair."""
    from ..._ragged import Ragged

    mask_shape = (*shape_q[:-2], shape_q[-2], shape_k[-2])
    rank = len(mask_shape)
    keep = align(ctx, mask, mask_shape, canonical_layout(rank, (rank - 2, rank - 1)), pairs)
    if not isinstance(keep, Tensor) or keep.ndim != rank - 1:
        return None
    lead = tuple(shape_q[:-2])
    if all(d == 1 for d in keep.shape[1:]):
        width = 1
    else:
        keep = keep.expand(keep.shape[0], *lead)
        width = math.prod(lead)
    keep = keep.reshape(keep.shape[0], width)
    if keep.shape[0] != pairs.total:  # one mask for every pair
        keep = keep.expand(pairs.total, width).contiguous()
    return Ragged(keep, pairs.offsets, pairs.sizes, Layout.standard(2, 1))


def _via_masked(
    q: RaggedB,
    k: RaggedB,
    v: RaggedB,
    mask: Any,
    causal: bool,
    scale: Any,
    dropout: float,
    step: Any,
    rank: int,
) -> Any:
    """Eagerly, a mask or dropout: ``attention_with_mask``, the loop's own SDPA call per
    sample (or length buckets with the mask in each box), never the pair formulation."""
    from ..._prims import has_tangent
    from ...ops._attention_masked import attention_with_mask

    tq, tk, tv = (_tokens(t) for t in (q, k, v))
    if has_tangent(q.values, k.values, v.values):  # no forward-mode rule in the fused kernel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            out = attention_with_mask(tq, tk, tv, mask, causal, scale, dropout, rank)
    else:
        out = attention_with_mask(tq, tk, tv, mask, causal, scale, dropout, rank)
    values = out.values.reshape((*q.values.shape[:-1], v.values.shape[-1]))
    return RaggedB(values.to(step.out.dtype), q.layout, q.sz, q.struct)


def _warn_pairs(ctx: Ctx, pairs: Any, lq: Any) -> None:
    """Eagerly: a ``RaggedPerformanceWarning`` when the pair formulation is estimated
    slower than the padded batch's fused kernel (``PAIR_COST`` per pair)."""
    if torch.compiler.is_compiling() or ctx.batch_size == 0:
        return
    longest = int(ctx.eval(lq).max())  # one host read, on this slow path only
    if pairs.total * PAIR_COST > ctx.batch_size * longest * longest:
        warnings.warn(
            "raggedfn.map: scaled_dot_product_attention runs as the (query, key) pair "
            "formulation, estimated slower than the padded batch (a mask that is not one "
            "tensor per (query, key) pair, or attention inside a compiled torch.func "
            "transform)",
            RaggedPerformanceWarning,
            stacklevel=2,
        )


@rule(aten.scaled_dot_product_attention)
def sdpa_rule(
    ctx: Ctx,
    step: Any,
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float | None = None,  # None: 0.0 (a float default costs a restart)
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    """Attention over ragged query/key axes: torch's kernels per sample or per length
    bucket (with the sample's mask where ``f`` gives one), else the packed pairs."""
    dropout = float(dropout_p) if dropout_p else 0.0
    if isinstance(attn_mask, LazyPairB) and not all(isinstance(t, RaggedB) for t in (q, k, v)):
        attn_mask = attn_mask.force()
    if not dropout and not any(isinstance(t, RaggedB) for t in (q, k, v, attn_mask)):
        return _fixed_shape(ctx, step, q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if enable_gqa:
        k, v = (_repeat_heads(ctx, t, logical(q), logical(t)) for t in (k, v))
    shape_q, shape_k, shape_v = logical(q), logical(k), logical(v)
    lq, lk = shape_q[-2], shape_k[-2]
    if (
        not isinstance(lq, Sz)
        or not isinstance(lk, Sz)
        or (
            shape_v[-2] is not lk and (not isinstance(shape_v[-2], Sz) or shape_v[-2].key != lk.key)
        )
    ):
        raise Unsupported("attention whose sequence axes are not ragged")
    if any(isinstance(s, Sz) for s in (*shape_q[:-2], *shape_k[:-2], shape_q[-1], shape_v[-1])):
        raise Unsupported("attention with ragged batch or feature axes")
    if not all(isinstance(t, RaggedB) for t in (q, k, v)):
        raise Unsupported("attention with fixed-size operands")
    q, k, v = (canonicalize(ctx, t) for t in (q, k, v))
    if isinstance(attn_mask, LazyPairB):
        out = _lazy(ctx, step, q, k, v, attn_mask, is_causal, scale, dropout, shape_q)
        if out is not None:
            return out
        attn_mask = attn_mask.force()
    if attn_mask is not None and _masks_nothing(attn_mask):
        attn_mask = None
    compiling = torch.compiler.is_compiling()
    usable = USE_RAGGED_ATTENTION and not compiled_transform()
    if usable and attn_mask is None and not dropout:
        _note(ctx, "fused")
        return _via_attention(q, k, v, is_causal, scale, step, len(shape_q))
    pairs = ctx.struct((lq, lk))
    if usable and not compiling:
        mask = None if attn_mask is None else _pair_mask(ctx, attn_mask, shape_q, shape_k, pairs)
        if attn_mask is None or mask is not None:
            _note(ctx, "fused" if mask is None else "fused with a mask")
            return _via_masked(q, k, v, mask, is_causal, scale, dropout, step, len(shape_q))
    if usable and compiling and not dropout:
        out = _via_varlen_mask(ctx, step, q, k, v, attn_mask, pairs, is_causal, scale)
        if out is not None:
            _note(ctx, "fused with a mask")
            return out
    _note(ctx, "pair formulation")
    _warn_pairs(ctx, pairs, lq)
    segments = pairs.segments()
    i, j = pairs.coords()
    rows_q = struct_rows(q.struct, segments, [i])
    rows_k = struct_rows(k.struct, segments, [j])
    # values: [T, *lead, E]; scores: [P, *lead]
    scores = (take_rows(q.values, rows_q) * take_rows(k.values, rows_k)).sum(-1)
    scale = 1.0 / math.sqrt(q.values.shape[-1]) if scale is None else scale
    scores = scores * scale
    if is_causal:
        scores = scores.masked_fill((j > i).reshape(-1, *([1] * (scores.ndim - 1))), float("-inf"))
    if attn_mask is not None:
        # the mask broadcast to (*lead, L, S), laid out like the pairs: [P, *lead]
        mask_shape = (*shape_q[:-2], lq, lk)
        rank = len(mask_shape)
        mask = align(
            ctx, attn_mask, mask_shape, canonical_layout(rank, (rank - 2, rank - 1)), pairs
        )
        if not isinstance(mask, Tensor):
            raise Unsupported("a scalar attention mask")
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    query_rows = struct_rows(q.struct, segments, [i])
    peak = segment(scores.detach(), query_rows, q.struct.total, "amax")
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    weights = (scores - take_rows(peak, query_rows)).exp()
    total = segment(weights, query_rows, q.struct.total, "sum")
    # a query whose keys are all masked gets zeros, as torch's SDPA (_safe_softmax)
    total_q = take_rows(total, query_rows)
    weights = torch.where(total_q == 0, 0.0, weights / total_q)
    if dropout:  # SDPA's dropout of the probabilities, one draw per (query, key) pair
        weights = torch.nn.functional.dropout(weights, dropout)
    out = segment(
        weights.unsqueeze(-1) * take_rows(v.values, rows_k), query_rows, q.struct.total, "sum"
    )
    return RaggedB(out.to(step.out.dtype), q.layout, q.sz, q.struct)


def _lazy(
    ctx: Ctx,
    step: Any,
    q: RaggedB,
    k: RaggedB,
    v: RaggedB,
    mask: LazyPairB,
    is_causal: bool,
    scale: Any,
    dropout: float,
    shape_q: tuple[Any, ...],
) -> Any:
    """Eagerly on CPU, a mask built from positions (``_lazy_pairs``): each sample's mask
    classified per distinct sizes. Every sample causal: ``is_causal=True``; every mask True
    everywhere: no mask (the same computation, and on CPU the same roundings); else, up
    to ``LOOP_MAX_BATCH`` samples, one SDPA call per sample with its own mask or flag.
    None where none of that applies (the mask is then materialized)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ...ops._attention import LOOP_MAX_BATCH

    if (
        is_causal
        or ctx.batch_size == 0
        or not USE_RAGGED_ATTENTION
        or compiled_transform()
        or torch.compiler.is_compiling()
        or any(t.values.device.type != "cpu" for t in (q, k, v))
        or len(shape_q) not in (3, 4)
    ):
        return None
    spec = mask.step.out.shape  # its last two axes must be the queries' and the keys'
    lq, lk = shape_q[-2], logical(k)[-2]
    if len(spec) > len(shape_q) or any(
        not isinstance(s, Sz) or s.key != want.key for s, want in ((spec[-2], lq), (spec[-1], lk))
    ):
        return None
    kinds = classify(mask)
    flags = [kind if isinstance(kind, frozenset) else frozenset() for kind in kinds]
    common = frozenset.intersection(*flags)
    rank = len(shape_q)
    if common:
        causal = "all" not in common
        _note(ctx, "fused, lazy mask: causal" if causal else "fused, lazy mask: dropped")
        if not dropout:
            return _via_attention(q, k, v, causal, scale, step, rank)
        return _via_masked(q, k, v, None, causal, scale, dropout, step, rank)
    if ctx.batch_size > LOOP_MAX_BATCH:
        return None
    from ...ops._attention_masked import attention_with_masks

    masks: list[Tensor | None] = []
    for kind in kinds:
        if isinstance(kind, frozenset):
            masks.append(None)
            continue
        n, m = kind.shape[-2:]
        if all(d == 1 for d in kind.shape[:-2]):
            masks.append(kind.reshape(1, n, m))
        else:  # a mask per head: the heads as _tokens flattens them
            masks.append(kind.expand(*shape_q[:-2], n, m).reshape(-1, n, m))
    causal_flags = [bool(kind) and "all" not in kind for kind in flags]
    _note(ctx, "fused, lazy mask: per sample")
    tq, tk, tv = (_tokens(t) for t in (q, k, v))
    kernel: Any = contextlib.nullcontext()
    if _prims.has_tangent(q.values, k.values, v.values):  # no forward-mode rule in the fused
        kernel = sdpa_kernel(SDPBackend.MATH)
    with kernel:
        out = attention_with_masks(tq, tk, tv, masks, causal_flags, scale, dropout, rank)
    values = out.values.reshape((*q.values.shape[:-1], v.values.shape[-1]))
    return RaggedB(values.to(step.out.dtype), q.layout, q.sz, q.struct)


def _fixed_shape(
    ctx: Ctx,
    step: Any,
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any,
    is_causal: bool,
    scale: Any,
    enable_gqa: bool,
) -> DenseB:
    """Attention over fixed-shape samples (a trace where a guard fixed the lengths, a
    fixed number of rows): one call of torch's kernel with the batch merged into the
    leading axes, as the loop calls it per sample (no ``torch.vmap``, whose fallback
    for the fused CPU kernel loops and warns)."""
    rank = len(logical(q))
    if rank < 2 or any(len(logical(t)) != rank for t in (k, v)):
        raise Unsupported("attention operands of different ranks")
    b = ctx.batch_size
    if b == 0:
        raise Unsupported("an empty batch")
    q, k, v = (
        t.data if isinstance(t, DenseB) else t.unsqueeze(0).expand(b, *t.shape) for t in (q, k, v)
    )
    if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        raise Unsupported("attention operands with broadcast batch axes")
    mask = attn_mask
    if isinstance(mask, DenseB):
        extra = rank - (mask.data.ndim - 1)
        if extra < 0:
            raise Unsupported("an attention mask of higher rank than the query")
        mask = mask.data.reshape(b, *([1] * extra), *mask.data.shape[1:])
    lead = q.shape[:-3] if rank >= 3 else None
    if lead is not None and len(lead) > 1:  # torch's kernels take 4-d operands
        q, k, v = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
        if isinstance(mask, Tensor):
            shape = (*lead, q.shape[-3], q.shape[-2], k.shape[-2])
            mask = mask.expand(shape).reshape(-1, *shape[-3:])
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    _note(ctx, "fused" if attn_mask is None else "fused with a mask")
    return DenseB(
        out.reshape(b, *out.shape[1:]) if lead is None else out.reshape(b, *step.out.shape)
    )
