"""Forward-mode plumbing (raggedfn._prims._forward): tangent detection, which rule set a
call uses, refusals under compile, attention's route, and forward mode through map."""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.utils import counters
from torch.func import grad, hessian, jacfwd, jacrev, jvp, linearize, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import raggedfn
from raggedfn import _prims
from raggedfn._prims import _forward

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
        ":DeprecationWarning"
    ),
    # the "fallback" cases run aten.flip per sample on purpose; map warns once per plan,
    # so whichever test runs them first sees the warning (a test run alone does too)
    pytest.mark.filterwarnings("ignore:raggedfn.map. aten.flip.default runs as a per-sample loop"),
]

F64 = torch.float64
LENGTHS = [3, 0, 2, 4]
X = raggedfn.from_lengths(torch.zeros(9, 4, dtype=F64), LENGTHS)
V = torch.linspace(-2, 2, 36, dtype=F64).reshape(9, 4).sin()
T = torch.linspace(1, -1, 36, dtype=F64).reshape(9, 4)


# ----- detecting a tangent --------------------------------------------------------------


def _seen(f):
    """Run ``f(record)``; return what ``has_tangent`` said inside."""
    seen: list[bool] = []

    def record(t: Tensor, *others: Tensor) -> Tensor:
        seen.append(_prims.has_tangent(t, *others))
        return t * 2

    f(record)
    return seen


@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node:UserWarning")  # linearize's
def test_has_tangent_under_each_transform() -> None:
    assert _seen(lambda r: r(V)) == [False]
    assert _seen(lambda r: grad(lambda v: r(v).sum())(V)) == [False]
    assert _seen(lambda r: vmap(r)(V)) == [False]
    assert _seen(lambda r: jacrev(r)(V)) == [False]
    assert _seen(lambda r: jvp(r, (V,), (T,))) == [True]
    assert _seen(lambda r: jacfwd(r)(V)) == [True]
    assert _seen(lambda r: hessian(lambda v: r(v).sum())(V)) == [True]
    assert _seen(lambda r: jvp(lambda v: vmap(r)(v), (V,), (T,))) == [True]
    # linearize runs f once plainly, then traces it with a dual level
    assert _seen(lambda r: linearize(r, V)) == [False, True]


def test_has_tangent_with_forward_ad_dual_tensors() -> None:
    with fwAD.dual_level():
        dual = fwAD.make_dual(V, T)
        assert _seen(lambda r: r(dual)) == [True]
        assert _seen(lambda r: r(V)) == [False]  # a plain tensor inside the level
        assert _seen(lambda r: r(V, dual)) == [True]
        assert _seen(lambda r: vmap(r)(dual)) == [True]  # wrapped: conservative
    assert _seen(lambda r: r(V)) == [False]


def test_call_picks_the_rule_set() -> None:
    """Eager: the Function with jvp, or its forward alone when nothing can ask for a
    derivative; compiled: the jvp-less one; compiled inside a transform or with
    forward mode: the plain forward body."""
    used: list[str] = []

    def rule(name: str) -> type:
        def apply(x: Tensor) -> Tensor:
            used.append(name)
            return x * 2

        def forward(x: Tensor) -> Tensor:
            used.append(f"{name}.forward")
            return x * 2

        return type(name, (), {"apply": staticmethod(apply), "forward": staticmethod(forward)})

    eager, compiled = rule("eager"), rule("compiled")

    def body(x: Tensor) -> Tensor:
        used.append("body")
        return x * 2

    def f(x: Tensor) -> Tensor:
        return _forward.call(eager, compiled, body, x).sum()  # type: ignore[arg-type]

    f(V.requires_grad_(False))
    f(V.detach().requires_grad_(True))
    with torch.no_grad():
        f(V.detach().requires_grad_(True))
    grad(f)(V)
    vmap(f)(V)
    with fwAD.dual_level():
        f(fwAD.make_dual(V, T))
    assert used == ["eager.forward", "eager", "eager.forward", "eager", "eager", "eager"]
    used.clear()
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="eager")(V)
    torch.compile(grad(f), fullgraph=True, backend="eager")(V)
    torch._dynamo.reset()
    torch.compile(lambda v: jvp(f, (v,), (T,)), fullgraph=True, backend="eager")(V)
    assert used == ["compiled", "body", "body"]


def test_a_call_without_derivatives_equals_the_function() -> None:
    """The forward run alone (no grad wanted) gives the Function's values, for every
    primitive that goes through ``call``."""
    segments = torch.tensor([0, 0, 2, 2, 2, 3, 3, 3, 3])
    with torch.no_grad():
        for prim in (_prims.segment_softmax, _prims.segment_log_softmax, _prims.segment_amax):
            alone = prim(V, segments, 5)
            with torch.enable_grad():
                tracked = prim(V.detach().requires_grad_(True), segments, 5)
            assert tracked.grad_fn is not None and alone.grad_fn is None
            torch.testing.assert_close(alone, tracked.detach(), rtol=0, atol=0)


# ----- attention takes the math backend when a tangent may be present -----------------


def _tokens(lengths: list[int], dtype: torch.dtype) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(sum(lengths), 2, 3, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values, lengths)


@pytest.mark.parametrize(
    "lengths", [[3, 0, 5], [4, 4, 4], [2] * 70], ids=["views", "uniform", "B70"]
)
def test_attention_under_forward_mode_equals_the_math_backend(lengths: list[int]) -> None:
    """Without the route, torch's fused CPU kernel raises under forward mode."""
    q = _tokens(lengths, torch.float32)
    tangent = torch.randn(q.values.shape, generator=torch.Generator().manual_seed(1))

    def f(values: Tensor) -> Tensor:
        x = q.with_values(values)
        return raggedfn.attention(x, x, x, causal=True).values

    got = jvp(f, (q.values,), (tangent,))
    with sdpa_kernel(SDPBackend.MATH):
        want = jvp(f, (q.values,), (tangent,))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(f(fwAD.make_dual(q.values, tangent)))
    torch.testing.assert_close(dual.tangent, got[1])
    # a plain input inside a dual level keeps the fused kernel: equal to the eager call
    with fwAD.dual_level():
        torch.testing.assert_close(f(q.values), f(q.values.clone()), rtol=0, atol=0)


# ----- forward mode under torch.compile ------------------------------------------------


def _compile_jvp(f, backend: str = "aot_eager"):
    torch._dynamo.reset()
    return torch.compile(lambda v: jvp(f, (v,), (T,)), fullgraph=True, backend=backend)


@pytest.mark.parametrize(
    ("name", "f"),
    [
        ("prod", lambda v: raggedfn.prod(X.with_values(v), 1)),
        (
            "attention",
            lambda v: raggedfn.attention(*[raggedfn.unsqueeze(X.with_values(v), 2)] * 3).values,
        ),
        ("einsum", lambda v: raggedfn.einsum("bnd,bmd->bnm", *[X.with_values(v)] * 2).values),
    ],
)
def test_forward_mode_inside_compile_is_refused_by_name(name: str, f) -> None:
    """fullgraph=True: dynamo's error carries the RaggedError; without it the transform
    falls back to eager and gives the eager answer."""
    with pytest.raises(Exception, match=rf"RaggedError.*{name}: forward-mode AD .* inside "):
        _compile_jvp(f)(V)
    torch._dynamo.reset()
    loose = torch.compile(lambda v: jvp(f, (v,), (T,)), backend="aot_eager")
    for g, w in zip(loose(V), jvp(f, (V,), (T,)), strict=True):
        torch.testing.assert_close(g, w)


def test_jvp_of_a_compiled_function_runs_eagerly_or_is_refused_by_torch() -> None:
    """Dynamo does not trace under an active functorch transform: a graph break runs the
    function eagerly (right answer), fullgraph=True raises."""

    def f(v: Tensor) -> Tensor:
        return raggedfn.softmax(X.with_values(v), 1).values

    torch._dynamo.reset()
    for g, w in zip(jvp(torch.compile(f), (V,), (T,)), jvp(f, (V,), (T,)), strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="functorch"):
        jvp(torch.compile(f, fullgraph=True), (V,), (T,))


def _softmax_values(v: Tensor) -> Tensor:
    return raggedfn.softmax(X.with_values(v), 1).values.sin()


def test_forward_ad_dual_tensors_through_compiled_code_with_aot_eager() -> None:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_softmax_values, fullgraph=True, backend="aot_eager")
    compiled(V)  # traced outside a dual level first: the level is guarded, so it retraces
    with fwAD.dual_level():
        got = fwAD.unpack_dual(compiled(fwAD.make_dual(V, T)))
    want = jvp(_softmax_values, (V,), (T,))
    torch.testing.assert_close(got.primal, want[0])
    torch.testing.assert_close(got.tangent, want[1])
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.xfail(strict=True, reason="torch 2.13 inductor drops forward_ad tangents (None)")
def test_forward_ad_dual_tensors_through_inductor_compiled_code() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_softmax_values, fullgraph=True)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(compiled(fwAD.make_dual(V, T)))
    assert got.tangent is not None


# ----- forward mode through raggedfn.map --------------------------------------------------


D = 4


def _per_sample(t: Tensor, w: Tensor) -> Tensor:
    """Batched ops only: linear, layer_norm, scores, softmax, SDPA, reductions."""
    h = F.layer_norm(F.linear(t, w), (D,))
    mixed = (h @ h.T / math.sqrt(D)).softmax(-1) @ h
    attended = F.scaled_dot_product_attention(h[None], h[None], h[None])[0]
    pooled = (mixed + attended).sum(0) + h.tanh().prod(0) + h.cumsum(0).sum(0)
    return pooled + (h.softmax(0) * h).sum(0)


def _flipped(t: Tensor, w: Tensor) -> Tensor:
    """aten.flip has no batching rule: that node runs per sample."""
    return (torch.flip(t, [0]) @ w).cumsum(0).sin().sum(0)


def _loop(fn, v: Tensor, w: Tensor) -> Tensor:
    return torch.stack([fn(t, w) for t in torch.split(v, LENGTHS)])


def _map(fn, v: Tensor, w: Tensor) -> Tensor:
    return raggedfn.map(fn, X.with_values(v), w, in_dims=(0, None))


W = torch.linspace(-1, 1, D * D, dtype=F64).reshape(D, D).cos() / 2
TW = torch.linspace(1, 2, D * D, dtype=F64).reshape(D, D)


@pytest.mark.parametrize("fn", [_per_sample, _flipped], ids=["batched", "fallback"])
def test_jvp_through_map_equals_the_loop(fn) -> None:
    report = raggedfn.map_report(fn, X.with_values(V), W, in_dims=(0, None))
    assert report.fully_batched == (fn is _per_sample)
    got = jvp(lambda v, w: _map(fn, v, w), (V, W), (T, TW))
    with sdpa_kernel(SDPBackend.MATH):
        want = jvp(lambda v, w: _loop(fn, v, w), (V, W), (T, TW))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(_map(fn, fwAD.make_dual(V, T), fwAD.make_dual(W, TW)))
    torch.testing.assert_close(dual.tangent, want[1])


# torch's own note that vmap over the fused CPU SDPA backward loops (jacrev inside hessian)
@pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching rule"
    ":UserWarning"
)
@pytest.mark.parametrize("fn", [_per_sample, _flipped], ids=["batched", "fallback"])
def test_hessian_of_a_map_loss_equals_the_loops(fn) -> None:
    def loss(f):
        return lambda w: f(fn, V, w).sin().sum()

    got = hessian(loss(_map))(W)
    with sdpa_kernel(SDPBackend.MATH):
        want = hessian(loss(_loop))(W)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        jacfwd(lambda v: _map(fn, v, W))(V), jacrev(lambda v: _map(fn, v, W))(V)
    )


# ----- extrema inside compiled transforms: the eager rule, value for value ------------------

EXTREMA_CASES = {
    "ties": [1.0, 1.0, 2.0, 2.0, 0.0, 3.0, -1.0],
    "nan": [1.0, math.nan, 2.0, 2.0, 0.0, 3.0, -1.0],
    "inf": [1.0, math.inf, 2.0, -math.inf, -math.inf, 3.0, -1.0],
    "zeros": [-0.0, -0.0, -1.0, -2.0, -3.0, -0.0, -5.0],
}


@pytest.mark.parametrize("largest", [True, False], ids=["amax", "amin"])
@pytest.mark.parametrize("case", sorted(EXTREMA_CASES))
def test_compiled_transforms_of_extrema_equal_eager(case: str, largest: bool) -> None:
    """Inside compiled transforms the extremum runs as plain torch ops (_extrema._composite):
    the same values (signed zeros, infinities) and derivatives (tie mean, 0 at NaN)."""
    segments = torch.tensor([0, 0, 2, 2, 2, 3, 0])
    values = torch.tensor(EXTREMA_CASES[case], dtype=F64).reshape(7, 1)
    values = values if largest else -values
    tangent = torch.arange(7, dtype=F64).reshape(7, 1)
    reduce = _prims.segment_amax if largest else _prims.segment_amin

    def f(v: Tensor) -> Tensor:
        return reduce(v, segments, 5)

    for g in (f, lambda v: vmap(f)(v[None])):  # values, signed zeros included
        torch._dynamo.reset()
        got = torch.compile(g, fullgraph=True, backend="aot_eager")(values)
        torch.testing.assert_close(got, g(values), equal_nan=True, rtol=0, atol=0)
        assert torch.equal(torch.signbit(got), torch.signbit(g(values)))
    for g in (lambda v: jvp(f, (v,), (tangent,))[1], jacrev(f), hessian(lambda v: f(v).sum())):
        torch._dynamo.reset()
        got = torch.compile(g, fullgraph=True, backend="aot_eager")(values)
        torch.testing.assert_close(got, g(values), equal_nan=True, rtol=0, atol=0)


REDUCTIONS = {
    "sum": raggedfn.sum,
    "mean": raggedfn.mean,
    "amax": raggedfn.amax,
    "amin": raggedfn.amin,
    "logsumexp": raggedfn.logsumexp,
    "prod": raggedfn.prod,
    "var": raggedfn.var,
    "std": raggedfn.std,
    "norm": lambda x, dim: raggedfn.norm(x, 2, dim),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_forward_tangents_of_reductions_are_finite_on_empty_samples(name: str) -> None:
    """DESIGN §4: the policy value of an empty sample (-inf max, ...) carries a finite
    (zero) tangent, as its gradient is finite; the mean's is NaN, as torch.mean's of an
    empty tensor (tests/test_prims_mean.py)."""
    _, tangent = jvp(lambda v: REDUCTIONS[name](X.with_values(v), 1), (V,), (T,))
    if name == "mean":
        _, want = jvp(lambda s: s.mean(0), (V[:0],), (T[:0],))
        assert want.isnan().all() and tangent[1].isnan().all()  # the empty sample
        tangent = tangent[[0, 2, 3]]
    else:
        assert (tangent[1] == 0).all()  # the empty sample
    assert torch.isfinite(tangent).all(), tangent


# ----- the remaining public ops: jacfwd == jacrev ------------------------------------------

IDS = torch.tensor([2, 0, 0, 1, 2, 2, 0, 1, 0])
W3 = torch.linspace(-1, 1, 3 * 4 * 2, dtype=F64).reshape(3, 4, 2)


def _x(v: Tensor) -> raggedfn.Ragged:
    return X.with_values(v)


def _pair_products(v: Tensor) -> Tensor:
    first, second = raggedfn.pairs(_x(v))
    return first.values * second.values


OTHER_OPS = {
    "pow": lambda v: raggedfn.pow(_x(v), 3).values,
    "norm": lambda v: raggedfn.norm(_x(v) + 1, 2, 1),
    "masked_select": lambda v: raggedfn.masked_select(_x(v), _x(V > 0)).values,
    "take_along_dim": lambda v: (
        raggedfn.take_along_dim(_x(v), raggedfn.argsort(_x(V), 1), 1).values
    ),
    "pairs": _pair_products,
    "group_by_segment_matmul": lambda v: (
        raggedfn.segment_matmul(raggedfn.group_by(v, IDS, 3)[0], W3).values
    ),
    "from_list": lambda v: (
        raggedfn.softmax(raggedfn.from_list(list(torch.split(v, LENGTHS))), 1).values
    ),
    "from_segment_ids": lambda v: (
        raggedfn.softmax(raggedfn.from_segment_ids(v, IDS.sort().values, 3), 1).values
    ),
    "shapes": lambda v: (
        raggedfn.flatten(
            raggedfn.transpose(raggedfn.unflatten(_x(v), 2, (2, 2)), 2, 3), 2, 3
        ).values
    ),
    "positions_where": lambda v: (
        raggedfn.where(raggedfn.unsqueeze(raggedfn.positions(_x(v)), 2) > 0, _x(v), -_x(v)).values
    ),
}


@pytest.mark.parametrize("name", sorted(OTHER_OPS))
def test_jacfwd_equals_jacrev_through_other_public_ops(name: str) -> None:
    """Ops the property tests do not push tangents through: forward mode runs and is
    the transpose of reverse mode."""
    f = OTHER_OPS[name]
    torch.testing.assert_close(jacfwd(f)(V), jacrev(f)(V))


def test_torch_nested_conversions_have_no_forward_mode_in_torch() -> None:
    """torch 2.13's jagged nested tensors have no forward-mode rule (nor torch.func
    support): to_nested under jvp fails in torch, as torch's own constructor does."""
    offsets = torch.tensor([0, 3, 3, 5, 9])
    torch_refusal = "TensorWrapper|forward AD with _nested_view_from_jagged"
    with pytest.raises(NotImplementedError, match=torch_refusal):
        jvp(lambda v: raggedfn.to_nested(raggedfn.from_offsets(v, offsets)).values(), (V,), (T,))
    with pytest.raises(NotImplementedError, match=torch_refusal):
        jvp(lambda v: torch.nested.nested_tensor_from_jagged(v, offsets).values(), (V,), (T,))
