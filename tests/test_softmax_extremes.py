"""softmax, log_softmax and logsumexp on +inf, -inf, all -inf, NaN and +-1e3 entries: every
path (segment_reduce, scatter, torch.func transforms, compiled, the composite bodies,
dense and ragged axes, nested axes, map's rules) equals torch's op on each sample alone,
in values and NaN pattern, and in gradients wherever torch's gradient is finite.

torch subtracts the raw max: a slice holding +inf, only -inf or a NaN is NaN throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import raggedfn
from property_tests.reference import samples
from raggedfn._prims import _softmax

INF, NAN = float("inf"), float("nan")
DTYPES = [torch.float32, torch.float64]

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def tokens(dtype: torch.dtype) -> raggedfn.Ragged:
    """``(B, N*)``: a +inf (beside 1e3, whose exp overflows), two +inf, +inf beside -inf,
    all -inf, NaN, +-1e3, -inf beside finite values, an empty sample and a single element."""
    rows = [
        [INF, 1.0, 2.0],
        [],
        [INF, 1e3, -2.0],
        [INF, INF, -3.0],
        [INF, -INF],
        [-INF, -INF],
        [NAN, 1e3, 2.0],
        [1e3, -1e3, 1e3],
        [-INF, 3.0, -1e3],
        [2.0],
    ]
    return raggedfn.from_list([torch.tensor(r, dtype=dtype) for r in rows])


def features(dtype: torch.dtype) -> raggedfn.Ragged:
    """``(B, N*, 3)``: the same kinds of entries along both axes."""
    gen = torch.Generator().manual_seed(0)
    parts = [3 * torch.randn(n, 3, generator=gen, dtype=dtype) for n in (3, 0, 2, 4, 1, 2)]
    parts[0][1, 0] = INF
    parts[0][:, 1] = -INF
    parts[0][0, 1] = INF
    parts[0][2, 2] = -INF
    parts[2][:, 1] = -INF
    parts[3][0, 2] = NAN
    parts[3][:, 0] *= 1e3
    parts[3][1, :2] = torch.tensor([800.0, INF])  # exp(800) overflows beside +inf in a row
    parts[4][0, 0] = -INF
    parts[5][:] = -INF
    return raggedfn.from_list(parts)


def pairs(dtype: torch.dtype) -> raggedfn.Ragged:
    """``(B, N*, N*)``: two ragged axes (segments are line starts, no bounds)."""
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, n, generator=gen, dtype=dtype) for n in (3, 0, 2, 4)]
    parts[0][1, 1] = INF
    parts[2][0, :] = -INF
    parts[3][2, 1] = NAN
    parts[3][0] *= 1e3
    parts[3][:, 3] = -INF
    return raggedfn.from_list(parts, ragged_dims=(1, 2))


VALUES = {"tokens": tokens, "features": features, "pairs": pairs}
# (value, logical dim) pairs that normalise along a ragged axis or a dense one
NORMALISE_DIMS = [("tokens", 1), ("features", 1), ("features", 2), ("pairs", 1), ("pairs", 2)]
LSE_DIMS = [*NORMALISE_DIMS, ("features", (1, 2)), ("pairs", (1, 2))]
OPS = {
    "softmax": (raggedfn.softmax, torch.softmax),
    "log_softmax": (raggedfn.log_softmax, torch.log_softmax),
    "logsumexp": (raggedfn.logsumexp, torch.logsumexp),
}


OP_DIMS = [(op, *case) for op in sorted(OPS) for case in NORMALISE_DIMS] + [
    ("logsumexp", *case) for case in LSE_DIMS[len(NORMALISE_DIMS) :]
]


def _sample_dim(dim: int | tuple[int, ...]) -> int | tuple[int, ...]:
    return dim - 1 if isinstance(dim, int) else tuple(d - 1 for d in dim)


def _per_sample(result: Any) -> list[torch.Tensor]:
    return samples(result) if isinstance(result, raggedfn.Ragged) else list(result.unbind(0))


def assert_samples(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal per sample: the same NaN positions and infinities, close finite values."""
    assert len(got) == len(want), f"batch sizes differ: {len(got)} vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, f"sample {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, i=i: f"sample {i}: {m}")


def check(
    run: Callable[[raggedfn.Ragged], Any],
    reference: Callable[[torch.Tensor], torch.Tensor],
    x: raggedfn.Ragged,
    grad: bool = True,
) -> None:
    """``run(x)`` equals ``reference`` on every sample; gradients equal torch's wherever
    torch's is finite (outputs inf or NaN on either side are left out of the loss)."""
    values = x.values.detach().clone().requires_grad_(grad)
    got = _per_sample(run(x.with_values(values)))
    leaves = [s.detach().clone().requires_grad_(grad) for s in samples(x)]
    want = [reference(s) for s in leaves]
    assert_samples([g.detach() for g in got], [w.detach() for w in want])
    if not grad:
        return
    gen = torch.Generator().manual_seed(7)
    cotangents = [torch.randn(w.shape, generator=gen, dtype=w.dtype) for w in want]
    masks = [w.detach().isfinite() & g.detach().isfinite() for w, g in zip(want, got, strict=True)]

    def loss(outs: list[torch.Tensor]) -> torch.Tensor:
        terms = zip(outs, cotangents, masks, strict=True)
        return sum((torch.where(m, o * c, 0.0).sum() for o, c, m in terms), torch.zeros(()))

    (mine,) = torch.autograd.grad(loss(got), values, allow_unused=True, materialize_grads=True)
    theirs = torch.autograd.grad(loss(want), leaves, allow_unused=True, materialize_grads=True)
    for i, (a, b, s) in enumerate(zip(samples(x.with_values(mine)), theirs, leaves, strict=True)):
        finite = b.isfinite()
        assert a[finite].isfinite().all(), f"sample {i}: gradient {a} where torch's is {b}"
        # a slope exp(x - lse) moves by eps * |x| where either side rounds lse (float32 at
        # 1e3: torch's exp(1e3 - fl(1e3 + log 2)) is 0.5 to within 3e-5, ours exact)
        tol = 4 * max(1, s.numel()) * torch.finfo(s.dtype).eps * _magnitude(s)
        torch.testing.assert_close(
            a[finite], b[finite], rtol=tol, atol=tol, msg=lambda m, i=i: f"sample {i}: {m}"
        )


def _magnitude(t: torch.Tensor) -> float:
    finite = t.detach()[t.detach().isfinite()]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    original = torch.segment_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "segment_reduce", spy)
    return calls


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "autograd"])
@pytest.mark.parametrize("path", ["segment_reduce", "scatter"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "dim"), NORMALISE_DIMS)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_of_extremes_equals_torch_per_sample(op, name, dim, dtype, path, grad, monkeypatch):
    """Without grad the Function's forward alone runs; with it, through autograd. Softmax
    along the one ragged axis of a CPU value takes torch.segment_reduce below the limit."""
    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", 10**9 if path == "segment_reduce" else 0)
    calls = _spy(monkeypatch)
    ours, theirs = OPS[op]
    x = VALUES[name](dtype)
    check(lambda v: ours(v, dim), lambda s: theirs(s, dim - 1), x, grad)
    fast = op == "softmax" and path == "segment_reduce" and name != "pairs" and dim == 1
    assert calls == (["max", "sum"] if fast else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "dim"), LSE_DIMS)
def test_logsumexp_of_extremes_equals_torch_per_sample(name, dim, dtype):
    """Dense axes only, ragged axes only, and both at once (one shift, one sum)."""
    x = VALUES[name](dtype)
    check(lambda v: raggedfn.logsumexp(v, dim), lambda s: torch.logsumexp(s, _sample_dim(dim)), x)


@pytest.mark.parametrize(("op", "name", "dim"), OP_DIMS)
def test_extremes_under_vmap(op, name, dim, monkeypatch):
    """Under torch.func.vmap the Functions' forwards see the transform (their first branch,
    never segment_reduce whatever the limit); vjp and grad run them below it instead."""
    monkeypatch.setattr(_softmax, "SEGMENT_REDUCE_MAX", 10**9)
    calls = _spy(monkeypatch)
    ours, theirs = OPS[op]

    def through_vmap(v: raggedfn.Ragged) -> Any:
        template = ours(v, dim)

        def f(values: torch.Tensor) -> torch.Tensor:
            out = ours(v.with_values(values), dim)
            return out.values if isinstance(out, raggedfn.Ragged) else out

        calls.clear()  # the template's own call, outside the transform
        both = torch.func.vmap(f)(torch.stack([v.values, v.values]))
        assert calls == []
        torch.testing.assert_close(both[0], both[1], equal_nan=True)
        return template.with_values(both[0]) if isinstance(template, raggedfn.Ragged) else both[0]

    x = VALUES[name](torch.float64)
    check(through_vmap, lambda s: theirs(s, _sample_dim(dim)), x, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_composite_bodies_on_extremes_equal_torch_per_segment(op, dtype):
    """The plain-op bodies that compiled torch.func transforms run (``_forward.call``)."""
    body = _softmax._softmax if op == "softmax" else _softmax._log_softmax
    x = tokens(dtype)
    segments = torch.repeat_interleave(torch.arange(x.batch_size), x.sizes[:, 0])
    reference = OPS[op][1]
    check(
        lambda v: v.with_values(body(v.values, segments, x.batch_size)),
        lambda s: reference(s, 0),
        x,
    )


def test_nested_axis_softmax_of_extremes_equals_torch_per_node():
    """Softmax over each node's incoming edges (a nested axis: its own segment ids)."""
    per_node = torch.tensor([3, 0, 2, 2, 1])
    values = torch.tensor([INF, 1.0, 2.0, -INF, -INF, NAN, 1e3, -1e3], dtype=torch.float64)
    for op in ("softmax", "log_softmax"):
        ours, theirs = OPS[op]
        x = raggedfn.from_nested_lengths(values, [torch.tensor([2, 3]), per_node])
        got = ours(x, 2).values
        want = torch.cat([theirs(part, 0) for part in values.split(per_node.tolist())])
        torch.testing.assert_close(got, want, equal_nan=True)


MAP_FUNCTIONS = {
    "softmax": lambda d: lambda t: t.softmax(d),
    "log_softmax": lambda d: lambda t: t.log_softmax(d),
    "safe_softmax": lambda d: lambda t: torch.ops.aten._safe_softmax(t, d),
    "logsumexp": lambda d: lambda t: t.logsumexp(d),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("fn", "name", "dim"),
    [(fn, *case) for fn in sorted(MAP_FUNCTIONS) for case in NORMALISE_DIMS]
    + [("logsumexp", *case) for case in LSE_DIMS[len(NORMALISE_DIMS) :]],
)
def test_map_rules_on_extremes_equal_the_loop(fn, name, dim, dtype):
    """strict=True: every node has a batching rule (no per-sample fallback hides one)."""
    f = MAP_FUNCTIONS[fn](_sample_dim(dim))
    check(lambda v: raggedfn.map(f, v, strict=True), f, VALUES[name](dtype))


def test_compiled_softmax_and_logsumexp_of_extremes_equal_torch_per_sample():
    """The compiled path (Functions' forward while compiling): one graph, torch's answers."""
    torch._dynamo.reset()
    counters.clear()

    def step(v: raggedfn.Ragged) -> tuple[Any, ...]:
        return (
            raggedfn.softmax(v, 1),
            raggedfn.log_softmax(v, 1),
            raggedfn.logsumexp(v, (1, 2)),
            raggedfn.softmax(v, 2),
        )

    x = features(torch.float32)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    got = compiled(x)
    assert counters["stats"]["unique_graphs"] == 1
    refs = [
        lambda s: torch.softmax(s, 0),
        lambda s: torch.log_softmax(s, 0),
        lambda s: torch.logsumexp(s, (0, 1)),
        lambda s: torch.softmax(s, 1),
    ]
    for out, ref in zip(got, refs, strict=True):
        assert_samples(_per_sample(out), [ref(s) for s in samples(x)])
