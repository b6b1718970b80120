"""``raggedfn.map`` behaviour around tracing that ``make mutate`` found untested
(docs/testing.md): in-place writes, the dependency check inside torch.compile, the
record of ``f`` over nested values, the variant registry.

Each test compares ``map`` with the per-sample loop (``property_tests.reference.loop``)
or checks how the call ran; each was seen failing with the surviving mutant it names
applied.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedPerformanceWarning
from raggedfn._map.caching import _cache
from raggedfn._map.entry import _compiled
from tests.test_map_mutants import LENGTHS, D, tokens, weights


@pytest.fixture(autouse=True)
def _cold():
    raggedfn.map_cache_clear()


# ----- in-place writes while tracing (tracing/_writes.py) ---------------------------------


def test_a_write_into_a_fresh_result_of_a_multi_output_op_on_an_argument_is_batched():
    # kills _writes.x__alias_root__mutmut_21 (``and`` -> ``or`` in the getitem walk):
    # w.max(0) makes fresh (values, indices); writing values writes no argument, so the
    # shared step runs once and the call stays batched. The mutant follows the getitem
    # back to w (a placeholder) and refuses: the whole call ran per sample
    x, w = tokens(), weights(6, D)
    before = w.clone()

    def f(t, w):
        v, _ = w.max(0)
        v.add_(1)
        return t * v

    report = raggedfn.map_report(f, x, w, in_dims=(0, None))
    assert report.fully_batched, str(report)
    assert report.whole_loop is None, str(report)
    assert_same(report.output, loop(f, x, w))
    assert torch.equal(w, before)  # the write stayed in the fresh result


COUNT = torch.zeros(D, dtype=torch.float64)


def _counts(t):
    torch.add(COUNT, 1, out=COUNT)  # a write into a captured tensor through out=
    return t * COUNT


def test_an_out_write_into_a_captured_tensor_happens_once_per_sample_as_in_the_loop():
    # kills NoRealWrites.__torch_function__ mutmut_27 (the out= target ignored): all of
    # add's inputs are real, so make_fx runs it for real while tracing; refused before it
    # runs, the captured tensor is written once per sample, as the loop writes it. The
    # mutant lets each trace write it too (the counts come out higher than the loop's)
    x = tokens()
    COUNT.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(_counts, x)
    got = COUNT.clone()
    assert report.whole_loop is not None and "f captures" in report.whole_loop, str(report)
    COUNT.zero_()
    expected = loop(_counts, x)
    assert torch.equal(got, COUNT), (got, COUNT)
    assert torch.equal(got, torch.full((D,), float(len(LENGTHS)), dtype=torch.float64))
    assert_same(report.output, expected)


# ----- the dependency check inside torch.compile (tracing/_deps.py) -----------------------


class _TrainOrEval(nn.Module):
    def forward(self, t):
        return t * 2 if self.training else t - 1


def test_the_compiled_check_sees_a_module_switched_between_train_and_eval(monkeypatch):
    # kills _deps._Walker._module mutmut_30 (the MODULE_HOOKS test inverted): inside
    # torch.compile the check leaves out only empty hook dictionaries (dynamo skips their
    # guards); the mutant left out every falsy entry of a module's __dict__ instead, such
    # as ``training`` after eval(), so train() kept the eval trace. Run as map's dynamo
    # branch eagerly (torch.compiler.is_compiling patched, as in test_map_mutants.py);
    # under the compiled check's own defaults (skip_nnmodule_hook_guards)
    assert _compiled._empty_hooks_unguarded()
    x = tokens()
    module = _TrainOrEval()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for training in (False, True, False, True):
        module.train(training)
        assert_same(raggedfn.map(module, x), loop(module, x))


# ----- the record of f over nested values (nested/_outer.py) ------------------------------


CALLS = itertools.count()
_SEEN = [0]


def _calls():
    """How many times ``_pool`` ran since the last look."""
    now = next(CALLS)
    ran, _SEEN[0] = now - _SEEN[0], now + 1
    return ran


def _pool(doc, w):
    next(CALLS)
    s = raggedfn.sum(doc, 1)  # [S, D]
    q = torch.softmax(w, dim=0)  # torch code on a shared argument, with a keyword
    return (s @ q.T).sum(0)


def _documents():
    gen = torch.Generator().manual_seed(4)
    shape = ([2, 3], [], [1], [0, 4, 2])
    return raggedfn.from_list(
        [[torch.randn(n, D, generator=gen, dtype=torch.float64) for n in doc] for doc in shape]
    )


def test_a_nested_record_runs_keyword_arguments_of_torch_code_on_shared_values():
    # kills nested._outer.Outside.__torch_function__ mutmut_30 (kwargs dropped when the
    # recorder calls func): the record of f (made once, reused by warm calls without
    # running f) runs softmax(w, dim=0) on the shared w. The mutant called softmax(w),
    # which raises: the record failed and every call took the cold path, running f again
    x, w = _documents(), weights(5, D)
    expected = torch.stack([_pool(x[i], w) for i in range(x.batch_size)])
    _calls()
    first = raggedfn.map(_pool, x, w, in_dims=(0, None))
    assert _calls() == 1  # recorded once, on the stand-ins
    second = raggedfn.map(_pool, x, w, in_dims=(0, None))
    assert _calls() == 0  # the warm call ran the record, not f
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)


# ----- the variant registry (caching/_cache.py) -------------------------------------------


def _double(t):
    return t * 2


def test_the_variant_registry_finds_a_variant_until_the_cache_is_cleared():
    # kills caching._cache._Variants.get mutmut_3 (the holder read when there is none):
    # REGISTRY.get is the lookup the compiled branch's registration goes through
    # (setdefault); an id with no holder (never registered, or after map_cache_clear) is
    # None, where the mutant raised AttributeError. No public call reaches get with a
    # missing id today (setdefault registers first): this pins the registry's contract
    x = tokens()
    assert_same(raggedfn.map(_double, x), loop(_double, x))
    entry = _cache.entry_of(_double, create=False)
    assert entry is not None and len(entry.variants) == 1
    variant = entry.variants[0]
    assert _cache.REGISTRY.get(variant.vid) is variant
    assert _cache.REGISTRY.setdefault(variant.vid, variant) is variant
    assert _compiled._registered(variant.vid) is variant
    assert _cache.REGISTRY.get(variant.vid + "-none") is None
    raggedfn.map_cache_clear()
    assert _cache.REGISTRY.get(variant.vid) is None
