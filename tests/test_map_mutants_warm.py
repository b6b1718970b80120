"""``raggedfn.map``'s warm call and in-place twins: behaviour that ``make mutate`` found
untested (docs/testing.md).

Each test compares ``map`` with the per-sample loop (``property_tests.reference.loop``)
and spies on the path the warm call took; each was seen failing with the surviving
mutant it names applied.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn._map.caching import _cache, _prepared
from tests.test_map_warm_call import tokens


@pytest.fixture(autouse=True)
def _fresh_cache() -> Any:
    _cache.clear()
    yield
    _cache.clear()


def _memos(f: Any) -> list[Any]:
    (entry,) = [e for k, e in _cache.CACHE.items() if k is f.__code__]
    return entry.warm


def test_warm_calls_on_leaf_arguments_take_the_flat_path(took):
    # kills _warm.x_remember__mutmut_62 (flat=all(type(a) is dict ...)): arguments that
    # are all leaves (Ragged values, tensors) are remembered as flat, so that the warm
    # call hands them over as they are; a shared dict of parameters is not flat (its
    # leaves are gathered). (Only a cost differs: the answers are the loop's either way.)
    x = tokens((3, 0, 2))
    w = torch.randn(3, 3, dtype=torch.float64)
    params = {"w": w, "b": torch.randn(3, dtype=torch.float64)}

    def leaf(t, w):
        return t @ w

    def tree(t, p):
        return t @ p["w"] + p["b"]

    for _ in range(2):
        assert_same(raggedfn.map(leaf, x, w, in_dims=(0, None)), loop(leaf, x, w))
        assert_same(raggedfn.map(tree, x, params, in_dims=(0, None)), loop(tree, x, params))
    assert took == [False, False, True, True]
    assert [m.flat for m in _memos(leaf)] == [True]
    assert [m.flat for m in _memos(tree)] == [False]


def test_a_warm_batched_pointwise_step_takes_the_prepared_shortcut(took, monkeypatch):
    # kills _prepared.x__step_fn__mutmut_46 (`not step.batched` -> `step.batched`): a
    # batched step with a rule gets the rule's closure (here the pointwise shortcut,
    # which runs the op on the packed values), never the general run_step; unbatched
    # steps (an op on the shared tensor only) go through run_step
    x = tokens((3, 0, 5, 1))
    w = torch.randn(3, dtype=torch.float64)

    def f(t, w):
        return t * 2 + (w * 3)

    want = loop(f, x, w)
    assert_same(raggedfn.map(f, x, w, in_dims=(0, None), chunk_elements=0), want)
    ran = []
    real = _prepared.run_step
    monkeypatch.setattr(
        _prepared,
        "run_step",
        lambda ctx, plan, step, *a: ran.append(step.batched) or real(ctx, plan, step, *a),
    )
    assert_same(raggedfn.map(f, x, w, in_dims=(0, None), chunk_elements=0), want)
    assert took == [False, True]
    assert ran == [False], ran  # w * 3 only
    names = [fn.__name__ for _, fn, _ in _prepared.prepared(_memos(f)[0].plan).steps]
    assert names.count("by_pointwise") == 2, names


_LIB = torch.library.Library("raggedfn_test_warm", "DEF")
_LIB.define("relu_(Tensor(a!) x) -> Tensor(a!)")
_LIB.impl("relu_", lambda x: x.mul_(3), "CompositeExplicitAutograd")
_LIB.impl("relu_", lambda x: x, "Meta")


def test_an_in_place_custom_op_is_not_taken_for_the_aten_op_of_its_name():
    # a custom op raggedfn_test_warm::relu_ (it triples x in place) on a fresh per-sample
    # value: functional_twin looked its twin up in torch.ops.aten by the bare name and
    # ran aten.relu instead (silently wrong); only aten's in-place ops have aten twins,
    # any other runs per sample. (_writes.x_functional_twin__mutmut_30, split("::")[+1],
    # differs only for a namespace holding "::" and is equivalent with this fix.)
    x = tokens((3, 0, 2))

    def f(t):
        h = t * 1.0
        torch.ops.raggedfn_test_warm.relu_(h)
        return h + 1

    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert "aten.relu.default" not in str(report), str(report)
