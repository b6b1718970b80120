"""group_by, segment_matmul (prim and op) and a mixture-of-experts layer built on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import raggedfn
from raggedfn import RaggedError
from raggedfn._prims import segment_matmul, segment_outer

# forward-mode AD's first dual level makes torch script a helper (torch's own warning)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

# group lengths 2, 0, 3, 1 (an empty group), K = 3, F = 4
OFFSETS = torch.tensor([0, 2, 2, 5, 6])
GROUPS, K, FEATURES = 4, 3, 4


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)

    def param(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    return param(6, K), param(GROUPS, K, FEATURES), param(GROUPS, FEATURES)


def _loop(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Row by row: each row times its group's weight."""
    group = torch.repeat_interleave(torch.arange(GROUPS), OFFSETS.diff())
    rows = [x[t] @ w[group[t]] + (0 if b is None else b[group[t]]) for t in range(x.shape[0])]
    return torch.stack(rows)


def test_segment_matmul_equals_the_row_loop_with_gradients() -> None:
    x, w, b = _inputs()
    for bias in (b, None):
        got = segment_matmul(x, OFFSETS, w, bias)
        expected = _loop(x, w, bias)
        torch.testing.assert_close(got, expected)
        cotangent = torch.randn_like(got)
        wrt = (x, w) if bias is None else (x, w, bias)
        for g, e in zip(
            torch.autograd.grad(got, wrt, cotangent),
            torch.autograd.grad(expected, wrt, cotangent),
            strict=True,
        ):
            torch.testing.assert_close(g, e)
    # the empty group's weight and bias get exactly zero gradient
    gw, gb = torch.autograd.grad(segment_matmul(x, OFFSETS, w, b).sum(), (w, b))
    assert not gw[1].any() and not gb[1].any()


def test_the_rules_dynamo_traces_equal_the_row_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While compiling, segment_matmul applies the jvp-less rule set (dynamo refuses a
    Function with ``jvp``); forced eagerly here (``is_compiling`` True), values and
    gradients to second order equal the row loop."""
    x, w, b = _inputs(1)
    cotangent = torch.randn(6, FEATURES, dtype=torch.float64)
    want = _loop(x, w, b)
    grads_want = torch.autograd.grad(want, (x, w, b), cotangent, create_graph=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = segment_matmul(x, OFFSETS, w, b)
    assert type(got.grad_fn).__name__ == "_SegmentMatmulBackward"
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got, (x, w, b), cotangent, create_graph=True)
    for g, e in zip(grads, grads_want, strict=True):
        torch.testing.assert_close(g, e)
    second = torch.autograd.grad(grads[1].sum(), x)[0]
    torch.testing.assert_close(second, torch.autograd.grad(grads_want[1].sum(), x)[0])


def test_gradcheck_gradgradcheck_and_forward_mode() -> None:
    x, w, b = _inputs(1)

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return segment_matmul(x, OFFSETS, w, b)

    assert gradcheck(f, (x, w, b))
    assert gradgradcheck(f, (x, w, b))
    assert gradcheck(f, (x, w, b), check_forward_ad=True, check_backward_ad=False)
    other = torch.randn(6, FEATURES, dtype=torch.float64, requires_grad=True)

    def outer(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return segment_outer(a, c, OFFSETS)

    assert gradcheck(outer, (x, other)) and gradgradcheck(outer, (x, other))
    assert gradcheck(outer, (x, other), check_forward_ad=True, check_backward_ad=False)
    # torch.func: jacfwd (the jvp rule) and jacrev agree; hessian-vector products run
    jf = torch.func.jacfwd(f, argnums=(0, 1, 2))(x, w, b)
    jr = torch.func.jacrev(f, argnums=(0, 1, 2))(x, w, b)
    for a, c in zip(jf, jr, strict=True):
        torch.testing.assert_close(a, c)
    inputs = torch.randn(2, 6, K, dtype=torch.float64)
    batched = torch.func.vmap(lambda v: f(v, w, b))(inputs)
    for n in range(2):
        torch.testing.assert_close(batched[n], _loop(inputs[n], w, b))


class _CountMatmuls(TorchDispatchMode):
    """Counts the matrix products that reach the dispatcher (and the biggest operand)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        for a in args:
            if isinstance(a, torch.Tensor):
                self.largest = max(self.largest, a.numel())
        return func(*args, **(kwargs or {}))


def test_one_gemm_per_non_empty_group_and_no_gathered_weights() -> None:
    """Forward: 3 products for 3 non-empty groups; backward: 3 for x and 3 for the weight.
    No tensor ever holds a weight per row ([T, K, F] = 72 elements here)."""
    x, w, b = _inputs(2)
    with _CountMatmuls() as counter:
        out = segment_matmul(x, OFFSETS, w, b)
    assert counter.count == 3
    with _CountMatmuls() as counter:
        torch.autograd.grad(out.sum(), (x, w, b))
    assert counter.count == 6
    assert counter.largest < 6 * K * FEATURES


def test_public_op_checks_its_arguments() -> None:
    x = raggedfn.from_offsets(torch.randn(6, K), OFFSETS)
    w = torch.randn(GROUPS, K, FEATURES)
    assert raggedfn.segment_matmul(x, w).shape == (GROUPS, None, FEATURES)
    for bad, message in (
        (
            lambda: raggedfn.segment_matmul(x, w[:2]),
            r"weight must have shape \[G, K, F\] = \[4, 3, F\]",
        ),
        (
            lambda: raggedfn.segment_matmul(x, w, torch.zeros(3)),
            r"bias must be a \[G, F\] = \[4, 4\]",
        ),
        (lambda: raggedfn.segment_matmul(x, w.double()), r"weight must be torch.float32"),
        (
            lambda: raggedfn.segment_matmul(raggedfn.unsqueeze(x, 2), w),
            r"x must have logical shape \(G, N\*, K\)",
        ),
        (lambda: raggedfn.group_by(torch.zeros(3, 2), torch.tensor([0, 5, 1]), 4), r"ids\[1\] = 5"),
        (
            lambda: raggedfn.group_by(torch.zeros(3, 2), torch.tensor([0.0, 1.0, 1.0]), 4),
            r"integer \[T\]",
        ),
        (
            lambda: raggedfn.from_segment_ids(torch.zeros(3), torch.tensor([0, 2, 1]), 3),
            r"must be sorted .*raggedfn.group_by",
        ),
        (
            lambda: raggedfn.from_segment_ids(torch.zeros(3), torch.tensor([0, 1, 3]), 3),
            r"\[0, 3\)",
        ),
    ):
        with pytest.raises(RaggedError, match=message):
            bad()


# ----- a mixture-of-experts layer -----------------------------------------------------------

TOKENS, DIM, HIDDEN, EXPERTS, TOP = 23, 6, 5, 4, 2


def moe_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def param(*shape: int) -> torch.Tensor:
        return (0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_(True)

    return {
        "router": param(DIM, EXPERTS),
        "w1": param(EXPERTS, DIM, HIDDEN),
        "b1": param(EXPERTS, HIDDEN),
        "w2": param(EXPERTS, HIDDEN, DIM),
        "b2": param(EXPERTS, DIM),
    }


def moe(
    x: torch.Tensor, p: dict[str, torch.Tensor], bias: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Top-2 routing; group_by -> segment_matmul -> gelu -> segment_matmul -> scatter back."""
    logits = x @ p["router"] + bias
    top, experts = logits.topk(TOP, dim=1)  # [T, TOP]
    gates = torch.softmax(top, dim=1)
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(TOP)
    grouped, order = raggedfn.group_by(x.index_select(0, token), experts.reshape(-1), EXPERTS)
    h = raggedfn.apply(F.gelu, raggedfn.segment_matmul(grouped, p["w1"], p["b1"]))
    y = raggedfn.segment_matmul(h, p["w2"], p["b2"]).values  # [T * TOP, DIM], grouped order
    weighted = y * gates.reshape(-1).index_select(0, order).unsqueeze(1)
    return x.new_zeros(x.shape).index_add(0, token.index_select(0, order), weighted)


def moe_loop(
    x: torch.Tensor, p: dict[str, torch.Tensor], bias: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Token by token, expert by expert."""
    logits = x @ p["router"] + bias
    rows = []
    for t in range(x.shape[0]):
        top, experts = logits[t].topk(TOP)
        gates = torch.softmax(top, 0)
        out = torch.zeros(DIM, dtype=x.dtype)
        for gate, e in zip(gates, experts.tolist(), strict=True):
            hidden = F.gelu(x[t] @ p["w1"][e] + p["b1"][e])
            out = out + gate * (hidden @ p["w2"][e] + p["b2"][e])
        rows.append(out)
    return torch.stack(rows)


def moe_tokens(seed: int, count: int = TOKENS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(count, DIM, generator=gen, dtype=torch.float64).requires_grad_(True)


def test_moe_layer_equals_the_per_token_loop_with_gradients() -> None:
    p = moe_params()
    x = moe_tokens(0)
    got, expected = moe(x, p), moe_loop(x, p)
    torch.testing.assert_close(got, expected)
    wrt = [x, *p.values()]
    cotangent = torch.randn_like(got)
    for g, e, name in zip(
        torch.autograd.grad(got, wrt, cotangent),
        torch.autograd.grad(expected, wrt, cotangent),
        ["x", *p],
        strict=True,
    ):
        torch.testing.assert_close(g, e, msg=lambda m, name=name: f"{name}: {m}")


def test_moe_layer_with_an_unused_expert() -> None:
    p = moe_params(1)
    bias = torch.tensor([0.0, 0.0, 0.0, -1e4], dtype=torch.float64)  # expert 3 never wins
    x = moe_tokens(1)
    torch.testing.assert_close(moe(x, p, bias), moe_loop(x, p, bias))
    grads = torch.autograd.grad(moe(x, p, bias).sum(), [p["w1"], p["b2"]])
    assert not grads[0][3].any() and not grads[1][3].any()
    assert grads[0][:3].abs().sum(dim=(1, 2)).gt(0).all()
