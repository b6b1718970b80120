"""Scaled dot-product attention whose backward recomputes the probabilities.

``torch.nn.functional.scaled_dot_product_attention`` with a float mask that
needs a gradient takes its math path on CPU, and autograd then keeps the whole
softmax ``[..., H, N, M]`` for the backward: for triangle attention on an
``N x N`` pair state that is ``N^3 * H`` floats per sample. This primitive keeps
only ``q, k, v``, the mask, the output and the row logsumexp ``[..., H, N]``; its
backward recomputes the probabilities from the logsumexp, one block of query
rows at a time (the flash-attention backward, in plain torch ops), so the
workspace is bounded and the backward is differentiable again.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._forward import call, forward_mode

# Logits held at once per block of query rows (forward and backward): 16 MiB in float32.
CHUNK_LOGITS = 1 << 22


def _query_block(q: Tensor, k: Tensor) -> int:
    """Query rows per block so that one block holds at most ``CHUNK_LOGITS`` logits."""
    n, m = q.shape[-2], k.shape[-2]
    batch = math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    return max(1, min(n, CHUNK_LOGITS // max(1, batch * m)))


def _rows(t: Tensor | None, lo: int, hi: int) -> Tensor | None:
    """Query rows ``lo:hi`` of a mask broadcastable to ``[..., N, M]`` (or of ``[..., N, D]``)."""
    if t is None or t.ndim < 2 or t.shape[-2] == 1:
        return t
    return _block(t, lo, hi)


def _block(t: Tensor, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` of axis -2 (``narrow``: torch's legacy vmap, which gradcheck's
    batched forward-mode check uses, has no rule for the ``alias`` that ``t[..., a:b, :]``
    makes of a whole axis)."""
    return t.narrow(-2, lo, min(hi, t.shape[-2]) - lo)


def _logits(scaled_q: Tensor, k: Tensor, bias: Tensor | None, keep: Tensor | None) -> Tensor:
    """``(q * scale) k^T + bias`` with ``-inf`` where ``keep`` is False (differentiable)."""
    # the scale goes on q ([N, Dh]), not on the logits ([N, M])
    logits = torch.matmul(scaled_q, k.transpose(-1, -2))
    if bias is not None:
        logits = logits + bias
    if keep is not None:
        logits = torch.where(keep, logits, float("-inf"))
    return logits


def _probabilities_in_place(
    scaled_q: Tensor, k: Tensor, bias: Tensor | None, keep: Tensor | None, lse: Tensor
) -> Tensor:
    """``exp(logits - lse)`` reusing one buffer; only where nothing records (no graph)."""
    logits = torch.matmul(scaled_q, k.transpose(-1, -2))
    shape = torch.broadcast_shapes(logits.shape, *(m.shape for m in (bias, keep) if m is not None))
    if shape != logits.shape:  # q and k broadcast against a larger mask
        logits = torch.broadcast_to(logits, shape).clone()
    if bias is not None:
        logits.add_(bias)
    if keep is not None:
        logits.masked_fill_(~keep, float("-inf"))
    return logits.sub_(lse).exp_()


def _finite_lse(logits: Tensor) -> Tensor:
    """Row logsumexp ``[..., N, 1]``; 0 for a row with no key left, whose probabilities are 0."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, keep: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    step = _query_block(q, k)
    scaled_q = q * scale
    outs, lses = [], []
    for lo in range(0, max(q.shape[-2], 1), step):
        hi = lo + step
        logits = _logits(scaled_q[..., lo:hi, :], k, _rows(bias, lo, hi), _rows(keep, lo, hi))
        lse = _finite_lse(logits)
        if torch.compiler.is_compiling():  # transforms there differentiate this body
            probs = torch.exp(logits - lse)
        else:  # the forward of a Function is not recorded: reuse the logits buffer
            probs = logits.sub_(lse).exp_()
        outs.append(torch.matmul(probs, v))
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-2)


class _Attention(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        keep: Tensor | None,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        return _forward(q, k, v, bias, keep, scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, bias, keep, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, bias, keep, out, lse)
        ctx.scale = scale

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor, grad_lse: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, None, None]:
        q, k, v, bias, keep, out, lse = ctx.saved_tensors
        scale = ctx.scale
        need_q, need_k, need_v, need_bias = ctx.needs_input_grad[:4]
        # d/dlogits of out is P * (dP - rowsum(dO * out)); of lse it is P
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            delta = delta - grad_lse
        step = _query_block(q, k)
        scaled_q = q * scale
        # without create_graph nothing records this backward: reuse the [rows, M] buffers
        in_place = not torch.is_grad_enabled() and not forward_mode()
        dqs: list[Tensor] = []
        dbiases: list[Tensor] = []
        dk: Tensor | None = None
        dv: Tensor | None = None
        for lo in range(0, max(q.shape[-2], 1), step):
            hi = lo + step
            q_rows, g_rows = scaled_q[..., lo:hi, :], grad_out[..., lo:hi, :]
            bias_rows, keep_rows, lse_rows = (
                _rows(bias, lo, hi),
                _rows(keep, lo, hi),
                lse[..., lo:hi, :],
            )
            if in_place:
                probs = _probabilities_in_place(q_rows, k, bias_rows, keep_rows, lse_rows)
            else:
                probs = torch.exp(_logits(q_rows, k, bias_rows, keep_rows) - lse_rows)
            if need_v:
                part = torch.matmul(probs.transpose(-1, -2), g_rows)
                dv = part if dv is None else dv + part
            if not (need_q or need_k or need_bias):
                continue
            dprobs = torch.matmul(g_rows, v.transpose(-1, -2))
            if in_place:
                dlogits = dprobs.sub_(delta[..., lo:hi, :]).mul_(probs)
            else:
                dlogits = probs * (dprobs - delta[..., lo:hi, :])
            if need_q:
                dqs.append(torch.matmul(dlogits, k) * scale)
            if need_k:
                part = torch.matmul(dlogits.transpose(-1, -2), q_rows)
                dk = part if dk is None else dk + part
            if need_bias:  # reduced block by block: the [..., rows, M] blocks are not kept
                assert bias is not None
                if bias.ndim >= 2 and bias.shape[-2] != 1:
                    target = (*bias.shape[:-2], dlogits.shape[-2], bias.shape[-1])
                else:
                    target = tuple(bias.shape)
                dbiases.append(dlogits.sum_to_size(target))
        dq = _join(dqs, q.shape) if need_q else None
        dk = _fit(dk, k.shape) if need_k else None
        dv = _fit(dv, v.shape) if need_v else None
        dbias = None
        if need_bias:
            assert bias is not None
            # query rows: concatenated where the bias has them, else summed
            if bias.ndim >= 2 and bias.shape[-2] != 1:
                dbias = dbiases[0] if len(dbiases) == 1 else torch.cat(dbiases, -2)
            else:
                dbias = dbiases[0]
                for d in dbiases[1:]:
                    dbias = dbias + d
        return dq, dk, dv, dbias, None, None


class _AttentionJvp(_Attention):
    """With the forward-mode rule (eager calls; see ``_forward``).

    With ``S`` the logits and ``P = exp(S - lse)``: ``dS = (dq k^T + q dk^T) * scale +
    dbias``, ``dlse = rowsum(P dS)``, ``dout = (P (dS - dlse)) v + P dv``, one block of
    query rows at a time like the forward (nothing ``[N, M]``-sized is kept).
    """

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        _Attention.setup_context(ctx, inputs, output)
        q, k, v, bias, keep, _ = inputs
        ctx.save_for_forward(q, k, v, bias, keep, output[1])

    @staticmethod
    def jvp(
        ctx: Any,
        dq: Tensor | None,
        dk: Tensor | None,
        dv: Tensor | None,
        dbias: Tensor | None,
        *_: None,
    ) -> tuple[Tensor, Tensor]:
        q, k, v, bias, keep, lse = ctx.saved_tensors
        return _tangents(q, k, v, bias, keep, lse, ctx.scale, dq, dk, dv, dbias)


def _tangents(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    keep: Tensor | None,
    lse: Tensor,
    scale: float,
    dq: Tensor | None,
    dk: Tensor | None,
    dv: Tensor | None,
    dbias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Tangents of ``(out, lse)`` given the input tangents (``None``: zero)."""
    step = _query_block(q, k)
    scaled_q = q * scale
    outs, lses = [], []
    for lo in range(0, max(q.shape[-2], 1), step):
        hi = lo + step
        q_rows = scaled_q[..., lo:hi, :]
        logits = _logits(q_rows, k, _rows(bias, lo, hi), _rows(keep, lo, hi))
        probs = torch.exp(logits - lse[..., lo:hi, :])
        dlogits: Tensor | None = None
        if dq is not None:
            dlogits = torch.matmul(_block(dq, lo, hi) * scale, k.transpose(-1, -2))
        if dk is not None:
            part = torch.matmul(q_rows, dk.transpose(-1, -2))
            dlogits = part if dlogits is None else dlogits + part
        bias_rows = _rows(dbias, lo, hi)
        if bias_rows is not None:
            dlogits = bias_rows if dlogits is None else dlogits + bias_rows
        out = None
        if dlogits is None:
            dlse = torch.zeros_like(lse[..., lo:hi, :])
        else:  # masked logits have P = 0: their (finite) tangents do not count
            weighted = probs * dlogits
            dlse = weighted.sum(dim=-1, keepdim=True)
            out = torch.matmul(weighted - probs * dlse, v)
        if dv is not None:
            part = torch.matmul(probs, dv)
            out = part if out is None else out + part
        if out is None:
            out = torch.zeros_like(torch.matmul(probs, v))
        outs.append(out)
        lses.append(dlse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-2)


def _join(parts: list[Tensor], shape: torch.Size) -> Tensor:
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    return _fit(whole, shape)


def _fit(grad: Tensor | None, shape: torch.Size) -> Tensor:
    """Reduce a gradient over the axes its input was broadcast along."""
    assert grad is not None
    return grad if grad.shape == shape else grad.sum_to_size(shape)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    keep: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """``softmax(q k^T * scale + bias, masked by keep) @ v``, saving no probabilities.

    Equal to ``torch.nn.functional.scaled_dot_product_attention(q, k, v,
    attn_mask=...)`` with ``bias`` (float) and ``keep`` (boolean) combined into
    the mask: a query row whose keys are all masked gives zeros and a zero
    gradient. The backward recomputes the probabilities from the saved row
    logsumexp in blocks of query rows and is itself differentiable.

    Args:
        q: ``[..., H, N, Dh]`` floating point.
        k: ``[..., H, M, Dh]``.
        v: ``[..., H, M, Dv]``.
        bias: added to the logits, broadcastable to ``[..., H, N, M]``; may
            require a gradient (returned reduced to its own shape).
        keep: boolean, broadcastable to ``[..., H, N, M]``; False masks a key.
        scale: logit scale, default ``1 / sqrt(Dh)``.

    Returns:
        ``[..., H, N, Dv]``.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, _ = call(_AttentionJvp, _Attention, _forward, q, k, v, bias, keep, scale)
    return out
