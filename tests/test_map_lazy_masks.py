"""Attention masks that ``f`` builds from positions stay lazy inside ``raggedfn.map``
(``raggedfn/_map/rules/_lazy_pairs.py``): attention classifies each sample's mask per
distinct size (causal -> ``is_causal``, True everywhere -> no mask, else the sample's own
mask), never materializing the packed pair state. Every path equals the per-sample loop
and the materialized path (``ENABLED = False``) eagerly, under ``torch.func.grad`` and
under ``torch.compile`` (where masks are materialized); a mask read from the data never
takes the lazy path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import raggedfn
from property_tests.reference import assert_same, samples
from raggedfn._map.caching import _cache
from raggedfn._map.rules import _lazy_pairs
from raggedfn.ops import _attention
from tests import test_map_attention_paths as paths

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

LENGTHS = (5, 9, 3, 1, 7, 9)  # two samples of length 9: one evaluation for both
H, D = 2, 4


def _x(lengths=LENGTHS, seed=0):
    return paths._x(lengths, seed)  # the same samples as the attention-path tests


_grid = paths._grid


MASKS = {
    "causal": lambda t, n: (lambda i, j: j <= i)(*_grid(n)),
    "causal tril": lambda t, n: torch.ones(n, n, dtype=torch.bool).tril(),
    "sliding window": lambda t, n: (lambda i, j: (j <= i) & (i - j < 3))(*_grid(n)),
    "bidirectional window": lambda t, n: (lambda i, j: (i - j).abs() <= 2)(*_grid(n)),
    "all true": lambda t, n: torch.ones(n, n, dtype=torch.bool),
    # from the data: a key takes part where its first feature is positive (and itself)
    "data": lambda t, n: (t[:, 0, 0] > 0)[None, :] | torch.eye(n, dtype=torch.bool),
    "per head": lambda t, n: torch.stack(
        [torch.ones(n, n, dtype=torch.bool).tril(), torch.ones(n, n, dtype=torch.bool)]
    ),
}
PATHS = {
    "causal": "fused, lazy mask: causal",
    "causal tril": "fused, lazy mask: causal",
    # lengths up to 3 are causal, longer ones windowed: each sample its own call
    "sliding window": "fused, lazy mask: per sample",
    "bidirectional window": "fused, lazy mask: per sample",
    "all true": "fused, lazy mask: dropped",
    "data": "fused with a mask",  # the materialized mask, as before
    "per head": "fused, lazy mask: per sample",
}


def _attend(kind, rank=4, layers=1):
    def f(t):
        n = t.shape[0]
        mask = MASKS[kind](t, n)  # built once, read by every layer (as transformers does)
        h = t.transpose(0, 1)  # [H, N, D]
        if mask.ndim == 2:
            mask = mask[None]
        if rank == 4:
            h, mask = h[None], mask[None]
        for _ in range(layers):
            h = F.scaled_dot_product_attention(h, h * 0.5, h, attn_mask=mask)
        return (h[0] if rank == 4 else h).transpose(0, 1)

    return f


def _values_and_grad(f, x):
    leaf = x.values.detach().requires_grad_()
    out = raggedfn.map(f, x.with_values(leaf))
    weight = torch.linspace(-1, 1, out.values.numel(), dtype=out.values.dtype)
    (grad,) = torch.autograd.grad((out.values * weight.view_as(out.values)).sum(), leaf)
    return out, grad, weight


def _loop(f, x, weight):
    parts = [s.detach().requires_grad_() for s in samples(x)]
    want = [f(p) for p in parts]
    flat = torch.cat([w.reshape(-1) for w in want])
    grads = torch.autograd.grad((flat * weight).sum(), parts)
    return want, torch.cat(grads)


@pytest.fixture
def spy(monkeypatch):
    """Counts of the lazy masks' classified sample evaluations and materializations."""
    seen = {"classified": 0, "force": 0}
    classified, force = _lazy_pairs._classified, _lazy_pairs.LazyPairB.force

    def counted_classified(value):
        seen["classified"] += 1
        return classified(value)

    def counted_force(self):
        seen["force"] += 1
        return force(self)

    monkeypatch.setattr(_lazy_pairs, "_classified", counted_classified)
    monkeypatch.setattr(_lazy_pairs.LazyPairB, "force", counted_force)
    return seen


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("kind", list(MASKS))
def test_each_mask_takes_its_path_and_equals_the_loop_and_the_materialized_mask(
    kind, rank, spy, monkeypatch
):
    f = _attend(kind, rank, layers=2)
    x = _x()
    report = raggedfn.map_report(f, x)
    assert report.attention == {PATHS[kind]: 2}, report.attention
    assert report.fully_batched
    lazy = kind != "data"
    assert spy["force"] == 0  # never materialized (the data mask is never lazy)
    got, grad, weight = _values_and_grad(f, x)
    want, want_grad = _loop(f, x, weight)
    assert_same(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(_lazy_pairs, "ENABLED", False)
    materialized = raggedfn.map_report(f, x).attention
    assert materialized == {"fused" if kind == "all true" else "fused with a mask": 2}
    off, off_grad, _ = _values_and_grad(f, x)
    assert torch.equal(got.values, off.values)
    assert torch.equal(grad, off_grad)
    plan = _cache.CACHE[f.__code__].variants[0].plans[0]
    assert bool(_lazy_pairs.lazy_steps(plan)) == lazy


def test_a_mask_is_evaluated_once_per_distinct_size_and_remembered(spy):
    f = _attend("sliding window", layers=3)
    raggedfn.map(f, _x())
    # one sample per distinct length, whatever the number of layers reading the mask
    assert spy["classified"] == len(set(LENGTHS))
    spy["classified"] = 0
    raggedfn.map(f, _x(seed=1))
    assert spy["classified"] == 0  # the next call: every size remembered on the plan
    raggedfn.map(f, _x((4, 12, 12, 9)))  # new lengths: evaluated once each
    assert spy["classified"] == 2
    assert spy["force"] == 0


def test_a_mask_read_from_the_data_is_never_remembered_by_size(monkeypatch):
    """Two batches with the same lengths and different values: a data mask per value."""
    f = _attend("data")
    for seed in (1, 2):
        x = _x(seed=seed)
        got, grad, weight = _values_and_grad(f, x)
        want, want_grad = _loop(f, x, weight)
        assert_same(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["causal", "sliding window"])
def test_large_batches(kind, spy, monkeypatch):
    """Beyond ``LOOP_MAX_BATCH`` samples a causal mask still becomes ``is_causal`` (the
    length buckets of the fused path); masks that differ per sample are materialized."""
    monkeypatch.setattr(_attention, "LOOP_MAX_BATCH", 2)
    f = _attend(kind)
    x = _x()
    report = raggedfn.map_report(f, x)
    want_path = "fused, lazy mask: causal" if kind == "causal" else "fused with a mask"
    assert report.attention == {want_path: 1}
    assert (spy["force"] > 0) == (kind != "causal")
    got, grad, weight = _values_and_grad(f, x)
    want, want_grad = _loop(f, x, weight)
    assert_same(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["causal", "sliding window", "bidirectional window", "data"])
def test_under_torch_func_grad(kind, monkeypatch):
    f = _attend(kind, layers=2)
    x = _x()
    weight = torch.linspace(-1, 1, x.values.numel(), dtype=x.values.dtype).view_as(x.values)

    def loss(values):
        return (raggedfn.map(f, x.with_values(values)).values * weight).sum()

    got = torch.func.grad(loss)(x.values)
    _, want = _loop(f, x, weight.reshape(-1))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(_lazy_pairs, "ENABLED", False)
    assert torch.equal(got, torch.func.grad(loss)(x.values))


@pytest.mark.parametrize("kind", ["causal", "sliding window"])
def test_compiled_step_materializes_and_makes_few_graphs(kind):
    f = _attend(kind)

    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, raggedfn.Layout.standard(1, 2))
        return raggedfn.map(f, x).values.square().sum()

    raggedfn.map(f, _x())  # traced eagerly first
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for seed, lengths in enumerate([(5, 9, 3), (7, 2, 6, 4), (8, 3), (11, 4, 6)]):
        x = _x(lengths, seed)
        leaf = x.values.detach().requires_grad_()
        (got,) = torch.autograd.grad(compiled(leaf, x.offsets, x.sizes), leaf)
        leaf_eager = x.values.detach().requires_grad_()
        (eager,) = torch.autograd.grad(step(leaf_eager, x.offsets, x.sizes), leaf_eager)
        parts = [s.detach().requires_grad_() for s in samples(x)]
        loop = torch.autograd.grad(sum(f(p).square().sum() for p in parts), parts)
        torch.testing.assert_close(got, torch.cat(loop), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got, eager, rtol=1e-10, atol=1e-10)
    assert counters["stats"]["unique_graphs"] <= 2


def test_row_chains_and_blocks_holding_a_lazy_step_run_step_by_step(monkeypatch):
    """Row tiles and blocks would compute a lazy step's values: such chains are dropped."""
    from types import SimpleNamespace

    f = _attend("sliding window")
    raggedfn.map(f, _x())
    plan = _cache.CACHE[f.__code__].variants[0].plans[0]
    lazy = _lazy_pairs.lazy_steps(plan)
    positions = [k for k, s in enumerate(plan.steps) if s.index in lazy]
    others = [k for k, s in enumerate(plan.steps) if s.index not in lazy]
    found = {0: SimpleNamespace(members=[others[0], positions[0]]), 1: SimpleNamespace(
        members=others[:2])}  # fmt: skip
    assert list(_lazy_pairs.outside(found, plan)) == [1]
    monkeypatch.setattr(_lazy_pairs, "ENABLED", False)
    assert list(_lazy_pairs.outside(found, plan)) == [0, 1]


def test_an_attention_call_its_rule_refuses_gets_the_materialized_mask(monkeypatch):
    """Where attention's rule gives up, the node's per-sample loop gets the mask's values."""
    import warnings

    from raggedfn import RaggedPerformanceWarning
    from raggedfn._map.base._sizes import Unsupported
    from raggedfn._map.rules import _attention as rules_attention

    def refuse(*args, **kwargs):
        raise Unsupported("refused for the test")

    monkeypatch.setattr(rules_attention, "canonicalize", refuse)
    f = _attend("sliding window")
    x = _x()
    assert raggedfn.map_report(f, x).attention == {"per sample": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        got, grad, weight = _values_and_grad(f, x)
    want, want_grad = _loop(f, x, weight)
    assert_same(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
