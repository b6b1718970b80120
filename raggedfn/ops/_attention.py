"""Per-sample scaled dot-product attention over ragged sequences.

Implementation (chosen by measurement on CPU, see ``docs/benchmarks-pairs.md``):
samples are grouped into length buckets (``_bucket.py``), each bucket is padded
to its own extents and run through one dense
``torch.nn.functional.scaled_dot_product_attention`` call with a key mask only
where the bucket needs one. Padding is bounded per bucket, so the work follows
``sum_i N_i * M_i`` rather than ``B * N_max * M_max``. Gradients come from
autograd through SDPA and the pad/unpad gathers. Small batches run one SDPA call
per sample instead; token attention without bias or key padding does so on views
of the packed values (no copies), also for larger batches with enough work per
sample, and equal lengths take one call on a view of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _prims
from .._errors import describe, fail
from .._layout import Layout
from .._prims import scaled_dot_product_attention as lean_sdpa
from .._ragged import Ragged
from . import _bucket
from ._attention_checks import check_arguments, check_tokens

__all__ = ["attention"]


def _nested_cuda(q: Ragged, k: Ragged, v: Ragged, causal: bool, scale: float | None) -> Ragged:
    """CUDA only: torch's jagged SDPA (varlen kernels) on views of the packed values."""
    from .._construct_interop import to_nested

    query, key, value = [to_nested(t).transpose(1, 2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    return q.with_values(out.transpose(1, 2).values())


LOOP_MAX_BATCH = 64  # up to this many samples: one SDPA call per sample (measured faster)
# one ragged axis, no bias/padding: per-sample SDPA on views (no copies) beats the buckets also
# for larger batches once a sample's work H * (Dh + Dv) * N * M averages this much (measured
# on CPU, fwd+bwd, B = 512: 0.69-0.78x of buckets' speed at 3e4-1.2e5, 1.17-1.22x at 1.9e5-1e6)
VIEWS_MIN_WORK = 300_000
CHUNK_LOGITS = 1 << 24  # at most this many logits per SDPA call (rows of triangle attention)


def _lean(bias: Tensor | None) -> bool:
    """A float bias that needs a gradient: torch's SDPA would take its math path and keep
    the whole softmax for the backward; the lean primitive keeps the row logsumexp."""
    return bias is not None and bias.requires_grad and torch.is_grad_enabled()


def _row_block(t: Tensor | None, lo: int, hi: int) -> Tensor | None:
    """Rows ``lo:hi`` of a per-sample mask ``[rows or 1, ...]`` (4 axes); others broadcast."""
    return t[lo:hi] if t is not None and t.ndim == 4 and t.shape[0] > 1 else t


def _per_sample(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    bias: Ragged | Tensor | None,
    key_padding: Ragged | None,
    causal: bool,
    scale: float | None,
) -> Ragged:
    """One dense SDPA call per sample on contiguous ``[rows, H, N, Dh]`` copies."""
    q_sizes, k_sizes = q.sizes.tolist(), k.sizes.tolist()
    r = q.num_ragged
    qs, ks, vs = (
        _bucket.sample_views(q, q_sizes),
        _bucket.sample_views(k, k_sizes),
        _bucket.sample_views(v, k_sizes),
    )
    pairs = [[s[-1], t[-1]] for s, t in zip(q_sizes, k_sizes, strict=True)]
    biases = _bucket.sample_views(bias, pairs) if isinstance(bias, Ragged) else None
    paddings = _bucket.sample_views(key_padding, k_sizes) if key_padding is not None else None
    outs = []
    for b in range(q.batch_size):
        heads = [t[b].movedim(-2, -3).contiguous() for t in (qs, ks, vs)]
        if r == 1:
            heads = [t.unsqueeze(0) for t in heads]  # [1, H, N, Dh]
        n, m = pairs[b]
        keep: Tensor | None = None
        if paddings is not None:
            keep = ~paddings[b].reshape(1 if r == 1 else q_sizes[b][0], 1, 1, m)
        use_is_causal = False
        if causal:
            if keep is None and bias is None and n == m:
                use_is_causal = True
            else:
                lower = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
                keep = lower if keep is None else keep & lower
        mask: Tensor | None = None
        if biases is not None:
            mask = biases[b].permute(2, 0, 1).unsqueeze(0)  # [1, H, N, M]
        elif isinstance(bias, Tensor):
            mask = bias[b if bias.shape[0] > 1 else 0] if bias.ndim == 4 else bias
        lean = _lean(mask)  # then bias and keep go to the primitive separately
        if mask is not None and keep is not None and not lean:
            mask = torch.where(keep, mask, float("-inf"))
        elif keep is not None and not lean:
            mask = keep
        # rows of a triangle attention in chunks: bounds the logits workspace per call
        rows, num_heads = heads[0].shape[0], heads[0].shape[1]
        step = max(1, CHUNK_LOGITS // max(1, num_heads * n * m))
        chunks = []
        for lo in range(0, max(rows, 1), step):
            part_q, part_k, part_v = [t[lo : lo + step] for t in heads]
            part_mask = _row_block(mask, lo, lo + step)
            if lean:
                part_keep = _row_block(keep, lo, lo + step)
                chunks.append(lean_sdpa(part_q, part_k, part_v, part_mask, part_keep, scale))
                continue
            chunks.append(
                F.scaled_dot_product_attention(
                    part_q,
                    part_k,
                    part_v,
                    attn_mask=part_mask,
                    is_causal=use_is_causal,
                    scale=scale,
                )
            )
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        if r == 1:
            out = out.squeeze(0)
        physical = out.movedim(-3, -2).permute(q.layout.logical_to_physical())
        outs.append(physical.flatten(0, r - 1))
    return Ragged(torch.cat(outs), q.offsets, q.sizes, q.layout)


def head_views(x: Ragged, counts: list[int], batch: bool) -> tuple[Tensor, ...]:
    """Each sample's ``[H, N_i, D]`` view of ``x``'s packed ``[T, H, D]`` values (``[1, H,
    N_i, D]`` with ``batch``): views of ``[H, T, D]``, with one head-major copy only where
    ``D`` is not the unit-stride axis (the kernel rounds differently there, and is slower)."""
    logical = x.values.permute(x.layout.physical_to_logical()).transpose(0, 1)
    if logical.stride(-1) != 1:
        logical = logical.contiguous()
    return logical.unsqueeze(0).split(counts, dim=2) if batch else logical.split(counts, dim=1)


def _per_sample_views(
    q: Ragged, k: Ragged, v: Ragged, sizes: dict[str, list[int]], causal: bool, scale: float | None
) -> Ragged:
    """One ragged axis, no bias, no key padding: one SDPA call per sample on strided
    ``[1, H, N_i, Dh]`` views of the packed values (no per-sample copies; torch's CPU
    kernel reads them in place), the outputs joined by one ``cat`` (backward: one ``split``).

    Same calls as :func:`_per_sample` on the same numbers, without its ``3 B`` copies in and
    ``B`` permuted copies out: 0.4-0.6x its time for BERT-sized batches (B <= 16, N ~ 20).
    """

    qs, ks, vs = (head_views(t, sizes[s], batch=True) for t, s in ((q, "n"), (k, "m"), (v, "m")))
    outs = []
    for query, key, value, n, m in zip(qs, ks, vs, sizes["n"], sizes["m"], strict=True):
        mask: Tensor | None = None
        if causal and n != m:
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal and n == m, scale=scale
        )
        # squeeze, not out[0]: a select's backward zero-fills and copies a [1, H, N, Dv]
        # gradient per sample (0.87-0.91x of the layer's attention fwd+bwd without it)
        outs.append(out.squeeze(0).transpose(0, 1))  # [N, H, Dv], logical
    values = torch.cat(outs).permute(q.layout.logical_to_physical()).contiguous()
    return Ragged(values, q.offsets, q.sizes, q.layout)


def _uniform(
    q: Ragged, k: Ragged, v: Ragged, n: int, m: int, causal: bool, scale: float | None
) -> Ragged | None:
    """All samples of length ``n`` (queries) and ``m`` (keys): one dense SDPA call on views
    of the packed values, no gather. ``None`` where the storage order does not allow it."""
    standard = Layout.standard(1, 2)
    if n == 0 or m == 0 or any(t.layout != standard for t in (q, k, v)):
        return None
    batch = q.batch_size

    def heads(t: Ragged, length: int) -> Tensor:
        # a view; a copy only where Dh is not the unit-stride axis (SDPA on CPU is slower on
        # those, while a unit-stride Dh with strided heads is faster than a copy: docs)
        view = t.values.view(batch, length, *t.values.shape[1:]).transpose(1, 2)
        return view if view.stride(-1) == 1 else view.contiguous()

    out = F.scaled_dot_product_attention(
        heads(q, n), heads(k, m), heads(v, m), is_causal=causal, scale=scale
    )
    return q.with_values(out.transpose(1, 2).reshape(batch * n, *out.shape[1:2], out.shape[-1]))


def attention(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    *,
    bias: Ragged | Tensor | None = None,
    key_padding: Ragged | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Ragged:
    """Scaled dot-product attention inside each sample.

    Sample ``i`` gets ``softmax(q_i k_i^T * scale + bias_i + mask_i) v_i`` per head,
    exactly ``torch.nn.functional.scaled_dot_product_attention`` run on that
    sample alone (heads moved in front of the sequence axis).

    With two ragged axes, ``q (B, I*, N*, H, Dh)`` and ``k, v (B, I*, M*, H, Dh)``
    attend independently for each of the ``I_i`` rows, and a pair-state ``bias
    (B, N*, M*, H)`` is shared by all rows: this is Pairformer triangle
    attention (``I_i = N_i = M_i``).

    Args:
        q: ``(B, N*, H, Dh)`` queries (or ``(B, I*, N*, H, Dh)``).
        k: ``(B, M*, H, Dh)`` keys (or ``(B, I*, M*, H, Dh)``).
        v: ``(B, M*, H, Dv)`` values, same partition as ``k``.
        bias: added to the logits. A pair state ``(B, N*, M*, H)`` with sizes
            ``(N_i, M_i)`` (pair bias), or a dense tensor of shape
            ``(..., H or 1, 1, 1)`` with at most 3 axes (shared by all samples)
            or 4 axes ``(B or 1, H or 1, 1, 1)`` (one row per sample).
        key_padding: boolean, same partition as ``k`` without the head axes,
            ``(B, M*)`` (or ``(B, I*, M*)``); True marks a key to ignore.
        causal: mask keys ``j > i`` inside each sample (top-left aligned, as
            SDPA's ``is_causal``).
        scale: logit scale, default ``1 / sqrt(Dh)``.

    Returns:
        ``(B, N*, H, Dv)`` with the partition and layout of ``q``. A query row
        whose keys are all masked (all padded, causal with ``M_i = 0``, or an
        empty key sequence) gives zeros, as torch's SDPA does on that sample
        alone, and a zero gradient. Under forward-mode AD (``torch.func.jvp``,
        ``jacfwd``, ``hessian``, dual tensors) it runs torch's math SDPA backend
        (the fused CPU kernel has no forward-mode derivative).

    Raises:
        RaggedError: ``q``, ``k`` or ``v`` is not ``Ragged`` with 1 or 2 ragged axes and
            logical shape ``(B, [I*,] N*, H, D)``; batch sizes, heads or head sizes that
            disagree; ``k`` and ``v`` with different partitions; with two ragged axes, ``q``
            and ``k`` with different row sizes ``I``; a ``bias`` that is neither a pair
            state with sizes ``(N_i, M_i)`` nor a dense ``(..., H or 1, 1, 1)`` tensor; a
            ``key_padding`` that is not a bool ``Ragged`` with the partition of ``k``;
            ``causal`` not a bool; forward-mode AD inside ``torch.compile`` (one opaque
            node there, see docs/transforms.md).

    Examples:
        >>> import torch, raggedfn
        >>> q = raggedfn.from_list([torch.randn(3, 2, 8), torch.randn(5, 2, 8)])
        >>> out = raggedfn.attention(q, q, q, causal=True)
        >>> out.shape, out.lengths.tolist()
        ((2, None, 2, 8), [3, 5])
    """
    if torch.compiler.is_compiling():  # the plan runs inside one opaque graph node
        return _compiled(q, k, v, bias, key_padding, causal, scale)
    tensors = [t.values if isinstance(t, Ragged) else t for t in (q, k, v, bias)]
    if _prims.has_tangent(*(t for t in tensors if isinstance(t, Tensor))):
        # torch's fused CPU kernels have no forward-mode derivative; the math path does
        with sdpa_kernel(SDPBackend.MATH):
            return _attention(q, k, v, bias, key_padding, causal, scale)
    return _attention(q, k, v, bias, key_padding, causal, scale)


def _compiled(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    bias: Ragged | Tensor | None,
    key_padding: Ragged | None,
    causal: bool,
    scale: float | None,
) -> Ragged:
    """:func:`_attention` as one opaque node (``_prims.host_planned``): its output has
    the partition and layout of ``q``; every check runs with the real tensors."""
    fn = "attention"
    q = check_tokens(fn, "q", q)
    k = check_tokens(fn, "k", k, q.num_ragged)
    v = check_tokens(fn, "v", v, q.num_ragged)
    if not isinstance(causal, bool):
        raise fail(fn, f"causal must be a bool, got {describe(causal)}")
    standard = Layout.standard(1, 2)
    if (
        q.values.device.type == "cpu"  # the op calls the CPU fused kernel
        and bias is None
        and key_padding is None
        and all(t.layout == standard for t in (q, k, v))
        and q.values.shape[1:] == k.values.shape[1:] == v.values.shape[1:]
    ):  # plain attention: the fused kernel's own backward, no recomputation
        out = _prims.varlen_attention(
            q.values, k.values, v.values, q.offsets, k.offsets, v.offsets, causal, scale
        )
        return q.with_values(out)
    tensors: list[Tensor] = []
    codes: list[str | None] = []
    for x in (q, k, v, bias, key_padding):
        if isinstance(x, Ragged):
            tensors += [x.values, x.offsets, x.sizes]
            codes.append(x.layout.code)
        elif isinstance(x, Tensor):
            tensors.append(x)
            codes.append("")
        elif x is None:
            codes.append(None)
        else:
            raise fail(fn, f"bias must be a Ragged pair state or a tensor, got {describe(x)}")
    # a plain string (dynamo folds string ops on constants, not json); codes hold no ";"
    meta = ";".join([*("-" if c is None else c for c in codes), str(causal), repr(scale)])
    shape = list(q.values.shape)
    # Dh -> Dv, where q stores Dh
    shape[1 + q.layout.axes[-1].index] = v.values.shape[1 + v.layout.axes[-1].index]
    values = _prims.host_planned("attention", meta, tensors, shape)
    return Ragged(values, q.offsets, q.sizes, q.layout)


@_prims.implement("attention")
def _compiled_impl(tensors: Sequence[Tensor], meta: str) -> Tensor:
    """The eager :func:`_attention` on the flattened arguments of :func:`_compiled`."""
    *fields, causal_text, scale_text = meta.split(";")
    codes = [None if c == "-" else c for c in fields]
    causal = causal_text == "True"
    scale = None if scale_text == "None" else float(scale_text)
    found = iter(tensors)
    args: list[Ragged | Tensor | None] = []
    for code in codes:
        if code:
            args.append(Ragged(next(found), next(found), next(found), Layout(code)))
        else:
            args.append(None if code is None else next(found))
    q, k, v, bias, key_padding = args
    assert isinstance(q, Ragged) and isinstance(k, Ragged) and isinstance(v, Ragged)
    assert key_padding is None or isinstance(key_padding, Ragged)
    return _attention(q, k, v, bias, key_padding, causal, scale).values


@torch.compiler.disable  # reads sizes on the host; under compile attention calls _compiled
def _attention(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    bias: Ragged | Tensor | None,
    key_padding: Ragged | None,
    causal: bool,
    scale: float | None,
) -> Ragged:
    q, k, v, sizes = check_arguments(q, k, v, bias, key_padding, causal)
    r = q.num_ragged
    q_symbols, k_symbols = (["i", "n"], ["i", "m"]) if r == 2 else (["n"], ["m"])

    if (
        q.device.type == "cuda"
        and r == 1
        and bias is None
        and key_padding is None
        and q.batch_size > 0
        and all(a.index == p for p, a in enumerate(q.layout.axes))
    ):
        try:  # torch's varlen kernels when they take the inputs; else the bucketed path
            return _nested_cuda(q, k, v, causal, scale)
        except (RuntimeError, NotImplementedError):
            pass

    uniform = len(set(zip(*sizes.values(), strict=True))) == 1
    if uniform and r == 1 and bias is None and key_padding is None:
        # every sample has the same lengths: the packed values are already a dense batch
        uniform_out = _uniform(q, k, v, sizes["n"][0], sizes["m"][0], causal, scale)
        if uniform_out is not None:
            return uniform_out
    # small batches: one SDPA call per sample (measured faster than padded buckets),
    # unless every sample has the same sizes: then one bucket holds them all, unpadded;
    # tokens without bias/padding: on views, also for large batches of enough work per sample
    if r == 1 and bias is None and key_padding is None and not uniform and q.batch_size > 0:
        pairs = sum(n * m for n, m in zip(sizes["n"], sizes["m"], strict=True))
        per_pair = math.prod(q.values.shape[1:]) + math.prod(v.values.shape[1:])  # H (Dh + Dv)
        if q.batch_size <= LOOP_MAX_BATCH or per_pair * pairs >= VIEWS_MIN_WORK * q.batch_size:
            return _per_sample_views(q, k, v, sizes, causal, scale)
    if 0 < q.batch_size <= LOOP_MAX_BATCH and not uniform:
        return _per_sample(q, k, v, bias, key_padding, causal, scale)

    buckets = _bucket.plan(sizes, q.batch_size)
    qs = _bucket.pad(q, q_symbols, buckets)
    ks = _bucket.pad(k, k_symbols, buckets)
    vs = _bucket.pad(v, k_symbols, buckets)
    biases = _bucket.pad(bias, ["n", "m"], buckets) if isinstance(bias, Ragged) else None
    dense_biases: Sequence[Ragged | Tensor | None]
    if isinstance(bias, Tensor) and bias.ndim == 4 and bias.shape[0] == q.batch_size:
        dense_biases = _bucket.pad_dense(bias, buckets)
    else:
        dense_biases = [bias] * len(buckets)
    paddings = _bucket.pad(key_padding, k_symbols, buckets) if key_padding is not None else None
    device = q.device
    outs = []
    for g, bucket in enumerate(buckets):
        count = len(bucket.samples)
        rows = bucket.extents.get("i", 1)
        n, m = bucket.extents["n"], bucket.extents["m"]
        # [G, (I), H, N, Dh]; contiguous: SDPA on CPU is ~2x slower on strided inputs
        query = qs[g].movedim(-2, -3).contiguous()
        key = ks[g].movedim(-2, -3).contiguous()
        value = vs[g].movedim(-2, -3).contiguous()
        # keep: [G, I or 1, 1, N or 1, M] boolean, None when nothing is masked
        keep = None
        lengths = [sizes["m"][b] for b in bucket.samples]
        if any(length < m for length in lengths):
            inside = torch.arange(m, device=device) < torch.tensor(lengths, device=device)[:, None]
            keep = inside.view(count, 1, 1, 1, m)
        if paddings is not None:
            kept = ~paddings[g].view(count, rows, 1, 1, m)
            keep = kept if keep is None else keep & kept
        use_is_causal = False
        if causal:
            lower = torch.ones(n, m, dtype=torch.bool, device=device).tril()
            if keep is None and bias is None and n == m:
                use_is_causal = True
            else:
                lower = lower.view(1, 1, 1, n, m)
                keep = lower if keep is None else keep & lower
        mask: Tensor | None = None
        if biases is not None:
            mask = biases[g].movedim(-1, 1).unsqueeze(1)  # [G, 1, H, N, M]
        elif isinstance(bias, Tensor):
            mask = cast(Tensor, dense_biases[g])  # bias is a Tensor: so are its entries
            mask = mask.view(*mask.shape[:-3], 1, *mask.shape[-3:]) if mask.ndim == 4 else mask
        if _lean(mask):  # broadcast bias and keep mask as they are: no [G * I, H, N, M] copy
            if r == 1:
                mask, keep = (
                    t.squeeze(1) if t is not None and t.ndim == 5 else t for t in (mask, keep)
                )
            lean_out = lean_sdpa(query, key, value, mask, keep, scale)  # [G, (I), H, N, Dv]
            outs.append(lean_out.movedim(-3, -2))
            continue
        if mask is not None and keep is not None:
            mask = torch.where(keep, mask, float("-inf"))
        elif keep is not None:
            mask = keep
        if r == 1:
            if mask is not None and mask.ndim == 5:
                mask = mask.squeeze(1)
        else:
            query = query.flatten(0, 1)
            key = key.flatten(0, 1)
            value = value.flatten(0, 1)
            if mask is not None:
                if mask.ndim < 5:
                    mask = mask.view(*([1] * (5 - mask.ndim)), *mask.shape)
                full = (count, rows, *mask.shape[2:])
                mask = mask.expand(full).reshape(count * rows, *mask.shape[2:])
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=use_is_causal, scale=scale
        )
        if r == 2:
            out = out.reshape(count, rows, *out.shape[1:])
        outs.append(out.movedim(-3, -2))
    return _bucket.unpad(outs, q.layout, q_symbols, buckets, sizes, q.batch_size)
