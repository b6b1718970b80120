"""Argument checks of ``attention``: shapes, partitions, bias and key padding.

:func:`check_arguments` runs eagerly before a path is chosen, and the sizes it
reads on the host also choose the path (``_attention``); under compile the opaque
node's eager body runs it with the real tensors, and the compiled entry
(``_attention._compiled``) checks the structure alone with :func:`check_tokens`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._axes import refuse_nested
from .._errors import describe, fail, shape_text
from .._ragged import Ragged
from . import _bucket

__all__: list[str] = []


def check_tokens(fn: str, name: str, x: object, num_ragged: int | None = None) -> Ragged:
    if not isinstance(x, Ragged):
        raise fail(fn, f"{name} must be a Ragged value, got {describe(x)}")
    refuse_nested(fn, x)
    r = x.num_ragged
    if num_ragged is None and r not in (1, 2):
        raise fail(
            fn, f"{name} must have 1 or 2 ragged axes, got logical shape {shape_text(x.shape)}"
        )
    if num_ragged is not None and r != num_ragged:
        raise fail(
            fn,
            f"{name} must have {num_ragged} ragged axes like q, got logical shape {shape_text(x.shape)}",
        )
    if x.layout.rank != r + 2 or not all(a.ragged for a in x.layout.axes[:r]):
        raise fail(
            fn,
            f"{name} must have logical shape (B, {'I*, ' if r == 2 else ''}N*, H, Dh) with the "
            f"ragged axes first, got {shape_text(x.shape)}",
        )
    return x


def check_arguments(
    q: Ragged,
    k: Ragged,
    v: Ragged,
    bias: Ragged | Tensor | None,
    key_padding: Ragged | None,
    causal: bool,
) -> tuple[Ragged, Ragged, Ragged, dict[str, list[int]]]:
    """``q``, ``k``, ``v`` checked, and the sizes per sample: ``"n"`` (queries), ``"m"``
    (keys) and, with two ragged axes, ``"i"`` (rows). Raises ``RaggedError`` as
    :func:`raggedfn.attention` documents."""
    fn = "attention"
    q = check_tokens(fn, "q", q)
    r = q.num_ragged
    k = check_tokens(fn, "k", k, r)
    v = check_tokens(fn, "v", v, r)
    if not (q.batch_size == k.batch_size == v.batch_size):
        raise fail(
            fn,
            f"q, k and v must have the same batch size, got {q.batch_size}, {k.batch_size} and "
            f"{v.batch_size}",
        )
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if k_shape[-1] != q_shape[-1] or not (q_shape[-2] == k_shape[-2] == v_shape[-2]):
        raise fail(
            fn,
            f"q (B, N*, H, Dh), k (B, M*, H, Dh) and v (B, M*, H, Dv) disagree: got {q_shape}, "
            f"{k_shape} and {v_shape}",
        )
    if not isinstance(causal, bool):
        raise fail(fn, f"causal must be a bool, got {describe(causal)}")
    q_sizes = _bucket.ragged_sizes(q)
    k_sizes = _bucket.ragged_sizes(k)
    if k_sizes != _bucket.ragged_sizes(v):
        raise fail(fn, "k and v must have the same partition (equal sizes per sample)")
    if r == 2 and q_sizes[0] != k_sizes[0]:
        raise fail(
            fn, f"q and k must share the row axis I: got sizes {q_sizes[0]} and {k_sizes[0]}"
        )
    sizes = {"n": q_sizes[-1], "m": k_sizes[-1]}
    if r == 2:
        sizes["i"] = q_sizes[0]
    heads = q_shape[-2]
    if isinstance(bias, Ragged):
        if bias.num_ragged != 2 or bias.shape[1:] != (None, None, heads):
            raise fail(
                fn,
                f"a Ragged bias must be a pair state (B, N*, M*, {heads}), got {shape_text(bias.shape)}",
            )
        b_sizes = _bucket.ragged_sizes(bias)
        if bias.batch_size != q.batch_size or b_sizes != [sizes["n"], sizes["m"]]:
            raise fail(
                fn,
                f"bias sizes {bias.sizes.tolist()} must be (N_i, M_i) = "
                f"{list(zip(sizes['n'], sizes['m'], strict=True))}",
            )
    elif isinstance(bias, Tensor):
        ok = bias.ndim <= 4 and bias.shape[-2:] == (1, 1) if bias.ndim >= 2 else False
        if ok and bias.ndim == 4:
            ok = bias.shape[0] in (1, q.batch_size)
        if not ok or (bias.ndim >= 3 and bias.shape[-3] not in (1, heads)):
            raise fail(
                fn,
                f"a dense bias must have shape (..., H or 1, 1, 1) (H = {heads}), got "
                f"{describe(bias)}; per-position biases must be Ragged pair states",
            )
    elif bias is not None:
        raise fail(fn, f"bias must be a Ragged pair state or a tensor, got {describe(bias)}")
    if key_padding is not None:
        if not isinstance(key_padding, Ragged) or key_padding.dtype != torch.bool:
            raise fail(
                fn, f"key_padding must be a boolean Ragged value, got {describe(key_padding)}"
            )
        if key_padding.layout.rank != r or _bucket.ragged_sizes(key_padding) != k_sizes:
            raise fail(
                fn,
                f"key_padding must have the partition of k without heads, got shape "
                f"{shape_text(key_padding.shape)}",
            )
    return q, k, v, sizes
