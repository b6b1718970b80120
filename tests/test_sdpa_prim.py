"""The memory-lean attention primitive: equal to torch's SDPA in values and gradients
(reverse and forward mode)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from raggedfn._prims import _sdpa, scaled_dot_product_attention

F64 = torch.float64


def _randn(*shape: int, seed: int, grad: bool = True) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_(grad)


def _keep(*shape: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(*shape, generator=gen) > 0.3
    keep[..., 1, :] = False  # a fully masked query row in every head
    return keep


def _reference(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, keep: Tensor | None, **kw: Any
) -> Tensor:
    mask: Tensor | None = bias
    if keep is not None:
        mask = keep if bias is None else torch.where(keep, bias, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


# name -> (bias shape or None, keep shape or None); q [2, 3, 5, 4], k/v [2, 3, 6, 4/2]
CASES: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]] = {
    "plain": (None, None),
    "bias": ((2, 3, 5, 6), None),
    "broadcast_bias": ((3, 5, 6), None),
    "head_bias": ((3, 1, 1), None),
    "row_bias": ((1, 3, 1, 6), None),
    "keep": (None, (2, 1, 5, 6)),
    "bias_and_keep": ((1, 3, 5, 6), (2, 1, 5, 6)),
}


def _inputs(name: str) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    bias_shape, keep_shape = CASES[name]
    q, k, v = _randn(2, 3, 5, 4, seed=0), _randn(2, 3, 6, 4, seed=1), _randn(2, 3, 6, 2, seed=2)
    bias = _randn(*bias_shape, seed=3) if bias_shape is not None else None
    keep = _keep(*keep_shape, seed=4) if keep_shape is not None else None
    return q, k, v, bias, keep


def _leaves(*tensors: Tensor | None) -> list[Tensor]:
    return [t for t in tensors if t is not None and t.requires_grad]


@pytest.mark.parametrize("chunk", [1 << 22, 7])
@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_torch_sdpa_in_values_and_gradients(
    name: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chunk 7: one query row per block, so the blocked forward and backward are exercised
    monkeypatch.setattr(_sdpa, "CHUNK_LOGITS", chunk)
    q, k, v, bias, keep = _inputs(name)
    want = _reference(q, k, v, bias, keep)
    got = scaled_dot_product_attention(q, k, v, bias, keep)
    torch.testing.assert_close(got, want)
    assert got.shape == want.shape
    cotangent = _randn(*want.shape, seed=5, grad=False)
    leaves = _leaves(q, k, v, bias)
    expected = torch.autograd.grad(want, leaves, cotangent)
    actual = torch.autograd.grad(got, leaves, cotangent)
    for a, e, leaf in zip(actual, expected, leaves, strict=True):
        assert a.shape == leaf.shape
        torch.testing.assert_close(a, e)


def test_fully_masked_rows_give_zeros_and_zero_gradients() -> None:
    q, k, v, bias, keep = _inputs("bias_and_keep")
    assert keep is not None and bias is not None
    out = scaled_dot_product_attention(q, k, v, bias, keep)
    assert (out[:, :, 1] == 0).all() and out[:, :, 0].abs().sum() > 0
    dq, dbias = torch.autograd.grad(out.sum(), [q, bias])
    assert (dq[:, :, 1] == 0).all() and (dbias[..., 1, :] == 0).all()
    assert torch.isfinite(dq).all() and torch.isfinite(dbias).all()
    # a -inf float bias masks a whole row the same way
    minus_inf = torch.zeros(5, 6, dtype=F64).index_fill(0, torch.tensor([2]), float("-inf"))
    out = scaled_dot_product_attention(q, k, v, minus_inf.requires_grad_(True))
    torch.testing.assert_close(out, _reference(q, k, v, minus_inf, None))
    assert (out[:, :, 2] == 0).all()


def test_scale_argument() -> None:
    q, k, v, bias, _ = _inputs("bias")
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, bias, scale=0.3),
        _reference(q, k, v, bias, None, scale=0.3),
    )


@pytest.mark.parametrize("chunk", [1 << 22, 7])
@pytest.mark.parametrize("name", ["bias", "broadcast_bias", "bias_and_keep", "keep"])
def test_gradcheck_and_gradgradcheck(
    name: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sdpa, "CHUNK_LOGITS", chunk)
    args, keep = _small(name)  # smaller shapes keep the finite differences fast

    def f(q: Tensor, k: Tensor, v: Tensor, *rest: Tensor) -> Tensor:
        return scaled_dot_product_attention(q, k, v, rest[0] if rest else None, keep)

    assert gradcheck(f, args)
    assert gradgradcheck(f, args)


def test_grad_of_grad_matches_torch_sdpa() -> None:
    q, k, v, bias, keep = _inputs("bias_and_keep")
    leaves = [q, k, v, bias]

    def second(f: Any) -> tuple[Tensor, ...]:
        out = f(q, k, v, bias, keep)
        firsts = torch.autograd.grad(out.pow(2).sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in firsts), leaves)

    for a, e in zip(second(scaled_dot_product_attention), second(_reference), strict=True):
        torch.testing.assert_close(a, e)


def test_torch_func_grad_vjp_and_vmap() -> None:
    q, k, v, bias, keep = _inputs("bias_and_keep")
    assert bias is not None
    q, k, v, bias = (t.detach() for t in (q, k, v, bias))
    cotangent = _randn(2, 3, 5, 2, seed=6, grad=False)

    def loss(f: Any) -> Any:
        return lambda q, k, v, b: (f(q, k, v, b, keep) * cotangent).sum()

    want = grad(loss(_reference), argnums=(0, 1, 2, 3))(q, k, v, bias)
    got = grad(loss(scaled_dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)

    out, pullback = vjp(
        lambda q, k, v, b: scaled_dot_product_attention(q, k, v, b, keep), q, k, v, bias
    )
    torch.testing.assert_close(out, _reference(q, k, v, bias, keep))
    for a, e in zip(pullback(cotangent), want, strict=True):
        torch.testing.assert_close(a, e)

    # per-example gradients over the leading axis
    def one(q: Tensor, k: Tensor, v: Tensor, b: Tensor) -> Tensor:
        return scaled_dot_product_attention(q, k, v, b).sin().sum()

    per_example = vmap(grad(one, argnums=3), in_dims=(0, 0, 0, None))(q, k, v, bias[0])
    expected = torch.stack([grad(one, argnums=3)(q[i], k[i], v[i], bias[0]) for i in range(2)])
    torch.testing.assert_close(per_example, expected)


def test_saves_no_probabilities() -> None:
    """What autograd keeps for the backward is O(N + M) per head, not O(N * M)."""
    q, k, v = _randn(1, 2, 64, 4, seed=0), _randn(1, 2, 64, 4, seed=1), _randn(1, 2, 64, 4, seed=2)
    bias = _randn(2, 64, 64, seed=3)
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scaled_dot_product_attention(q, k, v, bias)
    sizes = sorted(t.numel() for t in saved)
    # q, k, v, out (512 each), lse (128) and the bias itself (8192); no [1, 2, 64, 64] softmax
    assert sizes.count(bias.numel()) == 1 and max(sizes) == bias.numel()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert sorted(t.numel() for t in saved).count(bias.numel()) >= 2  # torch keeps the softmax


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_inputs_unmodified_and_dtype_kept(dtype: torch.dtype) -> None:
    q, k, v, bias, keep = _inputs("bias_and_keep")
    assert bias is not None and keep is not None
    q, k, v, bias = (t.detach().to(dtype) for t in (q, k, v, bias))
    copies = [t.clone() for t in (q, k, v, bias, keep)]
    out = scaled_dot_product_attention(q, k, v, bias, keep)
    assert out.dtype == dtype
    for t, c in zip((q, k, v, bias, keep), copies, strict=True):
        assert torch.equal(t, c)


@pytest.mark.parametrize("chunk", [1 << 22, 7])
def test_query_and_keys_broadcast_against_a_larger_mask(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q, k, v without the leading axis of the bias: gradients summed back over it."""
    monkeypatch.setattr(_sdpa, "CHUNK_LOGITS", chunk)
    q, k, v = _randn(3, 5, 4, seed=0), _randn(3, 6, 4, seed=1), _randn(3, 6, 2, seed=2)
    bias, keep = _randn(2, 3, 5, 6, seed=3), _keep(2, 1, 5, 6, seed=4)
    # torch's SDPA does not broadcast q against the mask: the reference expands q, k, v
    want = _reference(*(t.expand(2, *t.shape) for t in (q, k, v)), bias, keep)
    got = scaled_dot_product_attention(q, k, v, bias, keep)
    torch.testing.assert_close(got, want)
    cotangent = _randn(*want.shape, seed=5, grad=False)
    expected = torch.autograd.grad(want, [q, k, v, bias], cotangent)
    actual = torch.autograd.grad(got, [q, k, v, bias], cotangent)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)


# dynamo instantiates the Function class itself; torch warns about its own call
@pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)
def test_compiles_fullgraph_and_equals_eager() -> None:
    from torch._dynamo.utils import counters

    q, k, v, bias, keep = _inputs("bias_and_keep")

    def loss(q: Tensor, k: Tensor, v: Tensor, b: Tensor) -> Tensor:
        return scaled_dot_product_attention(q, k, v, b, keep).pow(2).sum()

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(loss, fullgraph=True)(q, k, v, bias)
    got_grads = torch.autograd.grad(got, [q, k, v, bias])
    want = loss(q, k, v, bias)
    want_grads = torch.autograd.grad(want, [q, k, v, bias])
    torch.testing.assert_close(got, want)
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, e)
    assert counters["stats"]["unique_graphs"] == 1


# ----- forward mode ------------------------------------------------------------------------


def _small(name: str) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """Small inputs for finite differences: (q, k, v[, bias]) and the keep mask."""
    q, k, v, bias, keep = _inputs(name)
    q, k, v = (t.detach()[:1, :2].requires_grad_(True) for t in (q, k, v))
    if bias is not None:
        bias = bias.detach()[..., -2:, :, :].requires_grad_(True) if bias.ndim >= 3 else bias
    if keep is not None:
        keep = keep[:1]
    return ((q, k, v) if bias is None else (q, k, v, bias)), keep


@pytest.mark.parametrize("chunk", [1 << 22, 7])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_mode_gradcheck_of_output_and_logsumexp(
    name: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sdpa, "CHUNK_LOGITS", chunk)
    args, keep = _small(name)

    def both(q: Tensor, k: Tensor, v: Tensor, *rest: Tensor) -> tuple[Tensor, Tensor]:
        bias = rest[0] if rest else None
        return _sdpa._AttentionJvp.apply(q, k, v, bias, keep, 0.5)

    def out(*a: Tensor) -> Tensor:
        return both(*a)[0]

    assert gradcheck(
        both, args, check_forward_ad=True, check_backward_ad=False, check_batched_forward_grad=True
    )
    assert gradgradcheck(out, args, check_fwd_over_rev=True)


@pytest.mark.parametrize("chunk", [1 << 22, 7])
@pytest.mark.parametrize("name", sorted(CASES))
def test_jvp_equals_torch_math_sdpa(name: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subset of tangents (None for the others), fully masked rows included."""
    monkeypatch.setattr(_sdpa, "CHUNK_LOGITS", chunk)
    q, k, v, bias, keep = (t.detach() if t is not None else None for t in _inputs(name))
    primals = [q, k, v] if bias is None else [q, k, v, bias]
    tangents = [_randn(*t.shape, seed=10 + n, grad=False) for n, t in enumerate(primals)]
    for which in range(len(primals)):
        for wrt in ([which], list(range(len(primals)))):

            def f(impl: Any, wrt: list[int] = wrt) -> Any:
                def run(*diff: Tensor) -> Tensor:
                    args = list(primals) + [None] * (4 - len(primals))
                    for n, t in zip(wrt, diff, strict=True):
                        args[n] = t
                    return impl(*args, keep)

                return run

            args = tuple(primals[n] for n in wrt)
            dirs = tuple(tangents[n] for n in wrt)
            got = jvp(f(scaled_dot_product_attention), args, dirs)
            with sdpa_kernel(SDPBackend.MATH):
                want = jvp(f(_reference), args, dirs)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)


def test_forward_mode_with_a_larger_mask_and_hessian() -> None:
    q, k, v = _randn(3, 5, 4, seed=0), _randn(3, 6, 4, seed=1), _randn(3, 6, 2, seed=2)
    bias, keep = _randn(2, 3, 5, 6, seed=3), _keep(2, 1, 5, 6, seed=4)
    q, k, v, bias = (t.detach() for t in (q, k, v, bias))

    def ours(q: Tensor, bias: Tensor) -> Tensor:
        return scaled_dot_product_attention(q, k, v, bias, keep)

    def theirs(q: Tensor, bias: Tensor) -> Tensor:
        return _reference(*(t.expand(2, *t.shape) for t in (q, k, v)), bias, keep)

    tangents = (_randn(*q.shape, seed=7, grad=False), _randn(*bias.shape, seed=8, grad=False))
    with sdpa_kernel(SDPBackend.MATH):
        want = jvp(theirs, (q, bias), tangents)
        want_hessian = hessian(lambda q: theirs(q, bias).sin().sum())(q)
    for g, w in zip(jvp(ours, (q, bias), tangents), want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(hessian(lambda q: ours(q, bias).sin().sum())(q), want_hessian)


@pytest.mark.parametrize("create_graph", [False, True])
def test_first_order_backward_reuses_its_buffers_only_without_a_graph(
    create_graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without create_graph the probabilities are recomputed in place (nothing records
    them); with it, differentiable ops. Both equal torch's SDPA gradients."""
    calls: list[int] = []
    original = _sdpa._probabilities_in_place

    def spy(*args: Any) -> Tensor:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(_sdpa, "_probabilities_in_place", spy)
    monkeypatch.setattr(_sdpa, "CHUNK_LOGITS", 7)  # one query row per block
    q, k, v, bias, keep = _inputs("bias_and_keep")
    leaves = _leaves(q, k, v, bias)
    got = scaled_dot_product_attention(q, k, v, bias, keep)
    want = _reference(q, k, v, bias, keep)
    cotangent = _randn(*want.shape, seed=5, grad=False)
    actual = torch.autograd.grad(got, leaves, cotangent, create_graph=create_graph)
    expected = torch.autograd.grad(want, leaves, cotangent)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
    assert len(calls) == (0 if create_graph else q.shape[-2])
