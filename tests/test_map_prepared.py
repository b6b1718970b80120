"""The prepared plans of ``raggedfn.map``'s warm call (``_prepared``: one closure per
step), compared with the general interpreter and the per-sample loop, and each
closure's way back to the general ``run_step`` (issue #18, per-call overhead)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedError, RaggedPerformanceWarning
from raggedfn._map.base._values import RaggedB
from raggedfn._map.caching import _cache, _prepared, _warm
from raggedfn._map.entry import _api
from raggedfn._map.running import _interpret
from tests.test_map_warm_call import tokens


@pytest.fixture(autouse=True)
def _fresh_cache() -> Any:
    _cache.clear()
    yield
    _cache.clear()


def _both(f: Any, *args: Any, budget: int = 0) -> tuple[Any, Any]:
    """The general interpreter's and the prepared plan's answer on one warm context."""
    raggedfn.map(f, *args)
    dims, leaves, treespec, kinds, batch = _api.prepare("map", args, 0)
    variant, lifted, _, _ = _api.lookup(f, leaves, kinds, treespec, dims)
    plan = variant.plans[0]
    prep = _prepared.prepared(plan)
    assert prep is not None
    ctx, inputs = _interpret.make_ctx(plan, leaves, batch, leaves[0].values.device, lifted)
    general = _interpret.run(plan, ctx, inputs, False, None)
    ctx, inputs = _interpret.make_ctx(plan, leaves, batch, leaves[0].values.device, lifted)
    return general, _prepared.run_prepared(prep, ctx, inputs, False)


W = torch.randn(3, 3, dtype=torch.float64)
B = torch.randn(3, dtype=torch.float64)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t * 2 + 1,  # the pointwise closure
        lambda t: t * t.sum(0),  # pointwise, a dense operand: the rule's general path
        lambda t: t * t.shape[0],  # a per-sample size as an operand
        lambda t: torch.add(t, t, alpha=2.0),  # keywords: the rule closure
        lambda t: torch.cat([t, t * 2], 0).sum(0),  # a list of references
        lambda t: t.max(0)[0],  # getitem of a tuple result
        lambda t: (t.sum(0), t @ W),  # a captured tensor, two outputs
        lambda t: t @ W + B,  # two captured tensors
        lambda t: t.softmax(0) + (W * 2).sum(),  # an op on shared values only
        lambda t: torch.ones(2, dtype=torch.float64) + t.sum(),  # a fixed-size output
    ],
)
def test_prepared_plans_equal_the_interpreter_and_the_loop(f, took):
    x = tokens((3, 2, 5, 1))
    general, prepared = _both(f, x)
    assert_same(raggedfn.map(f, x) if not isinstance(general, tuple) else general[0], _first(f, x))
    flat_g = general if isinstance(general, tuple) else (general,)
    flat_p = prepared if isinstance(prepared, tuple) else (prepared,)
    for g, p in zip(flat_g, flat_p, strict=True):
        if isinstance(g, raggedfn.Ragged):
            assert torch.equal(g.values, p.values) and torch.equal(g.offsets, p.offsets)
        else:
            assert torch.equal(g, p)
    want = loop(f, x)
    out = raggedfn.map(f, x)
    if isinstance(out, tuple):
        for j, o in enumerate(out):
            assert_same(o, [w[j] for w in want])
    else:
        assert_same(out, want)
    assert took[-1]


def _first(f: Any, x: Any) -> list[Any]:
    out = loop(f, x)
    return [o[0] for o in out] if isinstance(out[0], tuple) else out


@pytest.mark.parametrize(
    "f",
    [
        lambda t: torch.flip(t, [0]) * 2,  # no rule
        lambda t: t.flatten() * 2,  # a rule that says Unsupported for this use
    ],
)
def test_an_op_without_a_rule_loops_per_sample_from_the_prepared_plan(f, took):
    x = tokens((2, 0, 3))
    with warnings.catch_warnings():  # (chunk_elements=0: no row tiles, the prepared plan)
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        raggedfn.map(f, x, chunk_elements=0)
        assert_same(raggedfn.map(f, x, chunk_elements=0), loop(f, x))
    assert took == [False, True]
    with pytest.raises(RaggedError, match="strict=True"):
        raggedfn.map(f, x, strict=True, chunk_elements=0)  # (raised inside the warm call)
    assert took == [False, True]


def test_prepared_steps_take_run_steps_way_on_unexpected_operands():
    """What the plan alone cannot promise is checked at the call: an operand that is not
    batched runs the op as it is (as ``run_step``), and a result of another dtype than
    the traced one is cast (operands of another dtype than at the trace)."""
    f = lambda t: t * 2  # noqa: E731
    x = tokens((2, 3))
    raggedfn.map(f, x)
    plan = _cache_plan(f)
    ((_, fn, _),) = _prepared.prepared(plan).steps
    ctx, (a,) = _interpret.make_ctx(plan, [x], 2, x.values.device, [])
    plain = torch.randn(3, dtype=torch.float64)
    out = fn(ctx, [plain, None], False)
    assert type(out) is torch.Tensor and torch.equal(out, plain * 2)
    # the call's own partition (the shortcut's case), values of another dtype
    narrow = RaggedB(a.values.float(), a.layout, a.sz, a.struct)
    out = fn(ctx, [narrow, None], False)
    assert out.struct is a.struct and out.values.dtype == torch.float64
    torch.testing.assert_close(out.values, x.values * 2, rtol=1e-6, atol=1e-6)


def test_plans_with_tiles_run_through_the_general_interpreter(took, monkeypatch):
    """Row tiles need the general loop; with ``chunk_elements=0`` (no tiles) the same plan
    runs prepared."""
    from raggedfn._map.running import _blocks, _tiles
    from tests.test_map_chunks import captured

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 16)
    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)
    ran = []
    for name in ("run", "run_prepared"):
        real = getattr(_warm, name)
        monkeypatch.setattr(_warm, name, lambda *a, _n=name, _r=real: ran.append(_n) or _r(*a))
    f = captured
    x = tokens((3, 0, 5), width=4)
    want = loop(f, x)
    for budget in (1 << 40, 1 << 40, 0, 0):
        out = raggedfn.map(f, x, chunk_elements=budget)
        assert_same(out[0], [w[0] for w in want])
        assert_same(out[1], [w[1] for w in want])
    assert took == [False, True, True, True]
    assert _prepared.prepared(_cache_plan(f)).has_chains
    assert ran == ["run", "run_prepared", "run_prepared"]


def _cache_plan(f: Any) -> Any:
    (entry,) = [e for k, e in _cache.CACHE.items() if k is f.__code__]
    return entry.warm[0].plan


def test_plans_with_guards_are_not_remembered(took):
    f = lambda t: t * 2 if t.shape[0] > 2 else t  # noqa: E731
    x = tokens((3, 1, 4))
    for _ in range(2):
        assert_same(raggedfn.map(f, x), loop(f, x))
    assert took == [False, False]
    assert not _prepared.eligible(_api.lookup(f, *_prep(x))[0].plans[0])


def _prep(x: Any) -> tuple[Any, ...]:
    dims, leaves, treespec, kinds, _ = _api.prepare("map", (x,), 0)
    return leaves, kinds, treespec, dims
