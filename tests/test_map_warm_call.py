"""The warm call of ``raggedfn.map`` (``_warm``: recent hits found by a short key), each
shortcut forced and compared with the per-sample loop, and each one's way back to the
general path (issue #18, per-call overhead; the prepared plans it runs:
test_map_prepared.py). A call "took the warm path" when ``_warm.call`` returned a result
rather than ``MISS`` (the ``took`` fixture, tests/conftest.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop, samples
from raggedfn import RaggedError, RaggedPerformanceWarning
from raggedfn._map.caching import _cache
from raggedfn._map.entry import _api
from raggedfn._map.running import _chunked


def tokens(lengths: tuple[int, ...], width: int = 3, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), width, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values, torch.tensor(lengths))


@pytest.fixture(autouse=True)
def _fresh_cache() -> Any:
    _cache.clear()  # a lambda of a parametrized test is one code object: one entry
    yield
    _cache.clear()


def test_a_warm_call_skips_the_lookup_and_equals_the_loop(took, monkeypatch):
    f = lambda t: torch.tanh(t) * 2 + 1  # noqa: E731
    x = tokens((3, 0, 5, 1))
    assert_same(raggedfn.map(f, x), loop(f, x))
    lookups = []
    real = _api.lookup
    monkeypatch.setattr(_api, "lookup", lambda *a: lookups.append(1) or real(*a))
    before = raggedfn.map_cache_info(f).hits
    for seed in (1, 2):  # new values and new lengths: the same key
        y = tokens((2, 4, 0), seed=seed)
        assert_same(raggedfn.map(f, y), loop(f, y))
    assert took == [False, True, True]
    assert lookups == []
    assert raggedfn.map_cache_info(f).hits == before + 2


def test_rebound_captured_tensors_are_read_afresh():
    """The dependency check still runs: a rebound weight is used, without a new trace."""
    w = torch.randn(3, 4, dtype=torch.float64)

    def f(t):
        return t @ w

    x = tokens((2, 3))
    raggedfn.map(f, x)
    for _ in range(2):
        w = torch.randn(3, 4, dtype=torch.float64)  # (read by f)
        assert_same(raggedfn.map(f, x), loop(f, x))
    assert raggedfn.map_cache_info(f).traces == 1


class _Deep:
    pass


def _deep_holder(levels: int) -> Any:
    top = node = _Deep()
    for _ in range(levels):
        node.inner = _Deep()
        node = node.inner
    node.w = torch.randn(3, dtype=torch.float64)
    return top, node


DEEP_TOP, DEEP_LEAF = _deep_holder(12)  # deeper than the walk follows


def _reads_too_deep(t):
    node = DEEP_TOP
    while hasattr(node, "inner"):
        node = node.inner
    return t * node.w


def test_a_tensor_the_walk_cannot_find_is_never_served_warm(took):
    """f reads a tensor below the walk's depth limit: its trace is not cached (traced at
    every call, so never stale), so no warm memo may hold it either: a rebound tensor is
    used at the next call (the warm path once served the first trace's tensor)."""
    x = tokens((2, 0, 3))
    for step in range(3):
        with pytest.warns(RaggedPerformanceWarning, match="does not follow"):
            out = raggedfn.map(_reads_too_deep, x)
        assert_same(out, loop(_reads_too_deep, x))
        DEEP_LEAF.w = torch.randn(
            3, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
        )
    assert not any(took)
    assert raggedfn.map_cache_info(_reads_too_deep).traces == 3


def test_changed_state_f_reads_goes_back_to_the_general_path(took):
    scale = 2.0
    module = torch.nn.Dropout(0.5)

    def f(t):
        return module(t) * scale

    x = tokens((2, 3))
    module.eval()
    raggedfn.map(f, x)
    raggedfn.map(f, x)
    scale = 3.0  # (read by f)
    assert_same(raggedfn.map(f, x), loop(f, x))
    module.train()  # dropout draws: compare the zero pattern's complement only
    out = raggedfn.map(f, x)
    kept = out.values != 0
    torch.testing.assert_close(out.values[kept], (x.values * 2 * 3.0)[kept])
    assert took == [False, True, False, False]
    assert raggedfn.map_cache_info(f).traces == 3


@pytest.mark.parametrize(
    "other",
    [
        lambda: tokens((2, 3), dtype=torch.float32),  # another dtype
        lambda: tokens((2, 3), width=4),  # another fixed size
        lambda: raggedfn.from_list([torch.ones(3, 2), torch.ones(3, 4)], ragged_dims=(2,)),
    ],
)
def test_another_signature_misses_and_equals_the_loop(other, took):
    f = lambda t: t * 2  # noqa: E731
    x = tokens((2, 3))
    raggedfn.map(f, x)
    raggedfn.map(f, x)
    y = other()
    assert_same(raggedfn.map(f, y), loop(f, y))
    assert took == [False, True, False]
    assert_same(raggedfn.map(f, y), loop(f, y))  # remembered too: both are recent hits
    assert_same(raggedfn.map(f, x), loop(f, x))
    assert took[-2:] == [True, True]


def test_size_classes_of_two_ragged_axes_are_compared_at_every_call(took):
    """Equal lengths share one size symbol in the trace: another batch whose lengths
    differ must not reuse that plan (the loop raises there, so must map)."""
    f = lambda a, b: a + b  # noqa: E731
    x, y = tokens((2, 3), seed=1), tokens((2, 3), seed=2)
    raggedfn.map(f, x, y)
    assert_same(raggedfn.map(f, x, y), loop(f, x, y))
    z = tokens((3, 2), seed=3)
    with pytest.raises(RuntimeError, match="must match the size") as error:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RaggedPerformanceWarning)
            raggedfn.map(f, x, z)  # the per-sample loop: torch's own error, for sample 0
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 0"]
    assert took == [False, True, False]


def test_a_memo_of_other_size_classes_is_passed_over_for_an_older_one(took):
    """Two memos of one function that differ only in their size classes: a call whose
    classes match the older one is served warm by it (the newer one is skipped, not the
    end of the search)."""
    f = lambda a, b: a.sum(0) + b.sum(0)  # noqa: E731
    x, y = tokens((2, 3), seed=1), tokens((2, 3), seed=2)  # equal lengths: one class
    z = tokens((3, 2), seed=3)  # lengths unlike x's: two classes
    for a, b in ((x, y), (x, y), (x, z), (x, z), (x, y)):
        assert_same(raggedfn.map(f, a, b), loop(f, a, b))
    assert took == [False, True, False, True, True]


def test_autocast_and_the_default_dtype_go_back_to_the_general_path(took):
    w = torch.randn(3, 4)
    f = lambda t: t @ w  # noqa: E731
    x = tokens((2, 3), dtype=torch.float32)
    raggedfn.map(f, x)
    raggedfn.map(f, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = raggedfn.map(f, x)
        want = loop(f, x)
    assert out.values.dtype == torch.bfloat16
    assert_same(out, want)
    out = raggedfn.map(f, x)  # autocast off again: the float32 plan, not the one under it
    assert out.values.dtype == torch.float32
    assert_same(out, loop(f, x))
    # a trace that reads whether autocast is on: remembered only outside autocast
    g = lambda t: t * 2 if torch.is_autocast_enabled("cpu") else t - 1  # noqa: E731
    for on in (False, False, True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            assert_same(raggedfn.map(g, x), loop(g, x))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        g = lambda t: t.sum(0) + torch.ones(3)  # noqa: E731
        raggedfn.map(g, x)
        torch.set_default_dtype(old)
        out = raggedfn.map(g, x)
        assert out.dtype == torch.float32
        assert_same(out, loop(g, x))
    finally:
        torch.set_default_dtype(old)
    assert took == [False, True, False, True, False, True, False, True, False, False]


def test_in_dims_and_argument_kinds_are_part_of_the_key(took):
    f = lambda t, v: t.sum(0) + v.sum(0)  # noqa: E731
    x = tokens((2, 3))
    v = torch.randn(2, 3, dtype=torch.float64)
    raggedfn.map(f, x, v)
    want = [s.sum(0) + v[i].sum(0) for i, s in enumerate(samples(x))]
    assert_same(raggedfn.map(f, x, v), want)
    # the same tensor shared ([2, 3] per sample): the mapped plan would be wrong
    want = [s.sum(0) + v.sum(0) for s in samples(x)]
    assert_same(raggedfn.map(f, x, v, in_dims=(0, None)), want)
    out = raggedfn.map(f, x, torch.nn.Parameter(v), in_dims=(0, None))  # a Parameter too
    assert_same(out, want)
    assert took == [False, True, False, True]


def test_the_general_path_still_raises_its_errors(took):
    f = lambda t, u: t + u.sum()  # noqa: E731
    x = tokens((2, 1))
    u = torch.randn(2, 4, dtype=torch.float64)
    raggedfn.map(f, x, u)
    raggedfn.map(f, x, u)
    with pytest.raises(RaggedError, match="disagree on the batch size"):
        raggedfn.map(f, x, torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(RaggedError, match="0-d tensor"):
        raggedfn.map(lambda t, u: t, x, torch.tensor(1.0))
    with pytest.raises(RaggedError, match="in_dims entries"):
        raggedfn.map(f, x, u, in_dims=(0, 1))
    with pytest.raises(RaggedError, match="chunk_elements"):
        raggedfn.map(f, x, u, chunk_elements=-1)
    with pytest.raises(RaggedError, match="randomness must be"):
        raggedfn.map(f, x, u, randomness="other")
    assert took[:2] == [False, True] and not any(took[2:])


def test_shared_containers_of_tensors_take_the_warm_path(took):
    """A dict of parameters (in_dims=None): its tree spec and each tensor's metadata are
    the key, its tensors are read at every call."""
    f = lambda t, p: t @ p["w"] + p["b"] - p["c"]  # noqa: E731
    gen = torch.Generator().manual_seed(4)
    w, b, c = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((3, 3), (3,), (3,)))
    x = tokens((2, 0, 3))

    def want(p):
        return [s @ p["w"] + p["b"] - p["c"] for s in samples(x)]

    p = {"w": w, "b": b, "c": c}
    for _ in range(2):
        assert_same(raggedfn.map(f, x, p, in_dims=(0, None)), want(p))
    p = {"w": w * 2, "b": b + 1, "c": c}  # new tensors, the same spec
    assert_same(raggedfn.map(f, x, p, in_dims=(0, None)), want(p))
    assert took == [False, True, True]
    # b and c swapped in the dict's order: another spec (the leaves come in another order)
    q = {"w": w, "c": b, "b": c}
    assert_same(raggedfn.map(f, x, q, in_dims=(0, None)), want(q))
    # a number among the leaves: a constant of the trace, never remembered
    r = {"w": w, "b": b, "c": 0.5}
    assert_same(raggedfn.map(f, x, r, in_dims=(0, None)), want(r))
    r = {"w": w, "b": b, "c": 1.5}
    assert_same(raggedfn.map(f, x, r, in_dims=(0, None)), want(r))
    assert took[3:] == [False, False, False]
    # a list and a tuple of the same tensors: other specs
    g = lambda t, p: t @ p[0] + p[1]  # noqa: E731
    for container in (list, tuple, list):
        ps = container((w, b))
        assert_same(raggedfn.map(g, x, ps, in_dims=(0, None)), [s @ w + b for s in samples(x)])
    assert took[6:] == [False, False, True]


def test_randomness_error_and_strict_are_honoured_warm():
    d = lambda t: torch.nn.functional.dropout(t, 0.5)  # noqa: E731
    x = tokens((2, 3))
    raggedfn.map(d, x)
    raggedfn.map(d, x)
    with pytest.raises(RaggedError, match="randomness='error'"):
        raggedfn.map(d, x, randomness="error")
    f = lambda t: torch.flip(t, [0]).sum(0)  # noqa: E731  (flip: no batching rule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        raggedfn.map(f, x)
        assert_same(raggedfn.map(f, x), loop(f, x))
    with pytest.raises(RaggedError, match="strict=True"):
        raggedfn.map(f, x, strict=True)


def test_a_small_chunk_budget_runs_groups_warm(took, monkeypatch):
    groups = []
    real = _chunked.run_in_groups
    monkeypatch.setattr(_chunked, "run_in_groups", lambda b, fn: groups.append(b) or real(b, fn))
    f = lambda t: (t[:, None] * t[None]).sum(-1)  # noqa: E731  ([N, N] per sample)
    x = tokens((4, 4, 4, 4))
    raggedfn.map(f, x)
    raggedfn.map(f, x)
    assert not groups
    assert_same(raggedfn.map(f, x, chunk_elements=20), loop(f, x))
    assert took == [False, True, True]
    assert groups


def test_a_nested_value_is_never_taken(took):
    x = raggedfn.from_list(
        [raggedfn.from_list([torch.ones(2), torch.ones(3)]), raggedfn.from_list([torch.ones(1)])]
    )
    f = lambda s: s.values * 2  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        for _ in range(2):
            out = raggedfn.map(f, x)
    assert not any(took)
    assert out.values.tolist() == [2.0] * 6


def test_closures_of_one_code_each_find_their_own_memo(took):
    x = tokens((2, 3))

    def make(scale):
        return lambda t: t * scale

    fs = [make(2.0), make(3.0)]
    for _ in range(3):
        for f in fs:
            assert_same(raggedfn.map(f, x), loop(f, x))
    assert took == [False, False, True, True, True, True]


def test_evicted_variants_are_forgotten(monkeypatch):
    monkeypatch.setattr(_cache, "MAX_VARIANTS", 1)
    f = lambda t: t * 2  # noqa: E731
    x, y = tokens((2, 3)), tokens((2, 3), width=4)
    raggedfn.map(f, x)
    (entry,) = [e for k, e in _cache.CACHE.items() if k is f.__code__]
    assert len(entry.warm) == 1
    raggedfn.map(f, y)
    assert [m.variant for m in entry.warm] == entry.variants


def test_the_warm_path_is_never_taken_under_compile():
    """A compiled function that maps, after eager calls that left a warm memo: dynamo
    sees only the compiled path (one graph for new lengths, equal to eager)."""
    w = torch.randn(3, 4)
    f = lambda t, w: torch.tanh(t @ w)  # noqa: E731
    x = tokens((2, 3), dtype=torch.float32)
    raggedfn.map(f, x, w, in_dims=(0, None))
    raggedfn.map(f, x, w, in_dims=(0, None))
    assert raggedfn.map_cache_info(f).hits == 1  # the warm call (see the tests above)
    layout = x.layout

    def step(values, offsets, sizes, w):
        y = raggedfn.map(f, raggedfn.Ragged(values, offsets, sizes, layout), w, in_dims=(0, None))
        return y.values.sum(0)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for lengths in ((2, 3), (4, 2, 5), (3, 3), (5, 6, 7, 2)):
        y = tokens(lengths, dtype=torch.float32, seed=len(lengths))
        args = (y.values, y.offsets, y.sizes, w)
        torch.testing.assert_close(compiled(*args), step(*args))
    # (the first batch specializes B = 2, as without the warm path: 2 graphs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_generated_programs_give_the_same_answer_warm_and_cold(took):
    """Differential: 150 generated programs (property_tests/map_programs.py), each mapped
    twice with its shared arguments as separate tensors or as one dict (every other
    program); the warm call (the prepared plan, where the program qualifies) gives
    exactly the general path's values or error."""
    from property_tests.map_programs import params, program_stream

    names = list(params())
    dims = (0,) + (None,) * len(names)
    warm = warm_dict = 0
    outs_seen: list[bool] = []
    for _, program, batch in program_stream(5, 150, min_steps=2, max_steps=4):
        if "random" in program.tags():
            continue
        f = program.function()
        g = lambda s, *ts, f=f: f(s, dict(zip(names, ts, strict=True)))  # noqa: E731
        x = batch.ragged()
        outs = []
        took.clear()
        # every other program takes its parameters as one dict (a shared container)
        whole = len(outs_seen) % 2 == 1
        outs_seen.append(whole)
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RaggedPerformanceWarning)
                try:
                    if whole:
                        out = raggedfn.map(f, x, params(), in_dims=(0, None))
                    else:
                        out = raggedfn.map(g, x, *params().values(), in_dims=dims)
                except Exception as error:  # compared below: the same error both times
                    out = (type(error), str(error))
            outs.append(out)
        cold, hot = outs
        if took == [False, True]:
            warm += 1
            warm_dict += whole
        if isinstance(cold, tuple) and len(cold) == 2 and isinstance(cold[0], type):
            assert hot == cold, program.source()
            continue
        a, spec_a = torch.utils._pytree.tree_flatten(cold, is_leaf=_is_ragged)
        b, spec_b = torch.utils._pytree.tree_flatten(hot, is_leaf=_is_ragged)
        assert spec_a == spec_b, program.source()
        for u, v in zip(a, b, strict=True):
            if isinstance(u, raggedfn.Ragged):
                assert torch.equal(u.offsets, v.offsets) and torch.equal(u.sizes, v.sizes)
                assert u.layout.code == v.layout.code
                u, v = u.values, v.values
            if isinstance(u, torch.Tensor):
                assert u.dtype == v.dtype and u.shape == v.shape, program.source()
                assert torch.equal(u.isnan(), v.isnan()), program.source()
                assert torch.equal(u.nan_to_num(), v.nan_to_num()), program.source()
            else:
                assert u == v, program.source()
    # the warm path was exercised, with flat arguments and with the dict
    assert warm >= 30 and warm_dict >= 10, (warm, warm_dict)


def _is_ragged(v: Any) -> bool:
    return isinstance(v, raggedfn.Ragged)
