"""The warm-call shortcuts of ``raggedfn.map`` (issue #18, per-call overhead), each forced
and compared with the per-sample loop, and each one's way back to the general path:

* ``prepare``: arguments that are all ``Ragged`` values or plain tensors;
* ``make_ctx``: the placeholders' static parts remembered per plan;
* the pointwise rule: operands already in the result's layout and partition run as they
  are (``_same_rows``), anything else broadcasts through ``align``;
* ``to_output``: a result built without re-running ``Ragged``'s checks, which a rule's
  malformed result still meets.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedError
from raggedfn._map.base import _values
from raggedfn._map.base._sizes import Sz
from raggedfn._map.base._values import Ctx, RaggedB, Struct
from raggedfn._map.caching import _lookup
from raggedfn._map.entry import _api
from raggedfn._map.rules import _pointwise
from raggedfn._map.running import _fallback, _interpret


def tokens(lengths: tuple[int, ...], width: int = 3, seed: int = 0) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), width, generator=gen, dtype=torch.float64)
    return raggedfn.from_lengths(values, torch.tensor(lengths))


def _count(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """Record what ``module.name`` returns at each call."""
    seen: list[Any] = []
    original = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(module, name, spy)
    return seen


def _twice(f: Any, *args: Any, **kwargs: Any) -> Any:
    """A cold call and a warm one (the warm one is returned); both equal the loop."""
    first = raggedfn.map(f, *args, **kwargs)
    second = raggedfn.map(f, *args, **kwargs)
    return first, second


@pytest.mark.parametrize(
    ("f", "fast"),
    [
        (lambda t: t * 2 + 1, True),  # numbers beside one operand
        (lambda t: (t * t - t) / 3, True),  # the same operand twice, then its results
        (lambda t: t * torch.tensor(2.0, dtype=torch.float64), True),  # a 0-d tensor
        (lambda t: t * t.sum(0), False),  # a dense per-sample operand: broadcast
        (lambda t: t + t[:, :1], True),  # [N, 1] beside [N, 3]: same rows, torch broadcasts
        (lambda t: torch.where(t > 0, t, -t), True),
    ],
)
def test_pointwise_same_rows_shortcut_equals_the_loop(f, fast, monkeypatch):
    took = _count(monkeypatch, _pointwise, "same_rows")
    aligned = _count(monkeypatch, _pointwise, "align")
    x = tokens((3, 0, 5, 1))
    for out in _twice(f, x):
        assert_same(out, loop(f, x))
    assert any(r is not None for r in took) == fast
    if fast and all(r is not None for r in took):
        assert aligned == []


def test_two_inputs_of_one_size_class_broadcast_through_align(monkeypatch):
    """Equal lengths share a size symbol but not a partition object: the second operand
    is gathered to the first's rows by the general path (still the loop's answer)."""
    took = _count(monkeypatch, _pointwise, "same_rows")
    aligned = _count(monkeypatch, _pointwise, "align")
    x, y = tokens((3, 0, 2), seed=1), tokens((3, 0, 2), seed=2)
    f = lambda a, b: a * b + a  # noqa: E731
    for out in _twice(f, x, y):
        assert_same(out, loop(f, x, y))
    assert aligned, "a * b did not take the general path"
    assert None in took


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t * t.sum(0),  # a dense per-sample operand beside t
        lambda t: t + torch.arange(3.0, dtype=torch.float64),  # a shared [3] operand
        lambda t: torch.where(t > 0, t, t.mean(0)),
    ],
)
def test_align_hands_over_a_ragged_operand_in_the_results_rows_as_it_is(f, monkeypatch):
    """Beside an operand that broadcasts, ``align`` takes a ragged operand whose
    partition, layout and sizes are the result's own as it is (``ragged_alignment``'s
    first branch: no gather, no re-layout)."""
    found = _count(monkeypatch, _values, "ragged_alignment")
    x = tokens((3, 0, 5, 1))
    for out in _twice(f, x):
        assert_same(out, loop(f, x))
    assert found, "no ragged operand went through align"
    assert all(rows is None and finish is _values._same for rows, finish in found), found


def test_pointwise_shortcut_refuses_other_layouts_and_keywords(monkeypatch):
    """A transposed operand (same sizes, other layout) and a keyword operand go through
    align; a pair state's two ragged axes take the shortcut where they line up."""
    took = _count(monkeypatch, _pointwise, "same_rows")
    pairs = raggedfn.from_list(
        [torch.randn(n, n, dtype=torch.float64) for n in (2, 0, 3)], ragged_dims=(1, 2)
    )
    for f in (
        lambda p: p + p.transpose(0, 1),
        lambda p: torch.add(p, p, alpha=2.0),
        lambda p: p * 3 - 1,
    ):
        took.clear()
        for out in _twice(f, pairs):
            assert_same(out, loop(f, pairs))
        if "transpose" in repr(f.__code__.co_names):
            assert None in took
    assert any(r is not None for r in took)  # p * 3 - 1


def test_same_rows_memo_is_checked_against_each_operand():
    """The remembered (layout code, sizes) of a step only skips ``lines_up`` for the very
    same sizes tuple; another tuple is checked afresh, a misfit refused."""
    x = tokens((2, 3))
    dims, leaves, treespec, kinds, batch = _api.prepare("map", (x,), 0)
    f = lambda t: t * 2  # noqa: E731
    variant, lifted, _, _ = _api.lookup(f, leaves, kinds, treespec, dims)
    plan = variant.plans[0]
    ctx, inputs = _interpret.make_ctx(plan, leaves, batch, x.values.device, lifted)
    (step,) = plan.steps
    a = inputs[0]
    assert _pointwise.same_rows(ctx, step, (a, 2)) is a
    assert step._same_rows[1] is a.sz
    # the same sizes tuple and partition in a layout of another rank: lines_up refuses it
    # (the memo holds a.sz: it is only taken for the same layout code too)
    wide = raggedfn.from_lengths(torch.zeros(5, 3, 1), torch.tensor([2, 3])).layout
    d = RaggedB(a.values[..., None], wide, a.sz, a.struct)
    assert _pointwise.same_rows(ctx, step, (d, 2)) is None
    assert _pointwise.same_rows(ctx, step, (a, 2)) is a
    # a value with a size of another symbol (same partition object): refused
    other = Sz("s_other", lambda env: env[next(iter(env))])
    b = RaggedB(a.values, a.layout, (other,), a.struct)
    assert _pointwise.same_rows(ctx, step, (b, 2)) is None
    # another partition than the one ctx holds for the sizes: refused
    c = RaggedB(a.values, a.layout, a.sz, Struct(a.struct.sizes, a.struct.offsets, 5))
    assert _pointwise.same_rows(ctx, step, (c, 2)) is None
    # a list operand or a one-element tensor that is not 0-d: refused
    assert _pointwise.same_rows(ctx, step, (a, [2])) is None
    assert _pointwise.same_rows(ctx, step, (a, torch.ones(1))) is None


@pytest.mark.parametrize(
    "args_dims",
    [
        ("tokens", 0),
        ("tokens_and_dense", (0, 0)),
        ("tokens_and_weight", (0, None)),
        ("pairs", 0),
        ("shared_ragged", (0, None)),
    ],
)
def test_flat_arguments_and_placeholders_equal_the_loop(args_dims, monkeypatch):
    """The flat-argument preparation and the remembered placeholders, warm, for each kind
    of leaf (ragged with one and two axes, dense mapped, shared tensor, shared Ragged)."""
    flat = _count(monkeypatch, _lookup, "_prepare_flat")
    name, dims = args_dims
    x = tokens((3, 0, 2))
    gen = torch.Generator().manual_seed(3)
    if name == "tokens":
        args, f = (x,), (lambda t: torch.tanh(t) * 2)
    elif name == "tokens_and_dense":
        d = torch.randn(3, 3, generator=gen, dtype=torch.float64)
        args, f = (x, d), (lambda t, v: t * v)
    elif name == "tokens_and_weight":
        w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
        args, f = (x, w), (lambda t, w: t @ w + 1)
    elif name == "pairs":
        sizes = torch.tensor([[2, 3], [0, 1], [1, 2]])
        values = torch.randn(6 + 0 + 2, 3, generator=gen, dtype=torch.float64)
        args, f = (raggedfn.from_sizes(values, sizes),), (lambda p: p.sum(1) * 2)
    else:
        args, f = (x, x), (lambda t, s: t.sum(0) + 1)
    for out in _twice(f, *args, in_dims=dims):
        shared = [a if d is None else None for a, d in zip(args, _dims(dims, args), strict=True)]
        mapped = [a for a, d in zip(args, _dims(dims, args), strict=True) if d == 0]
        want = _loop_with_shared(f, mapped, shared)
        assert_same(out, want)
    assert flat and all(r is not None for r in flat)


def _dims(dims: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return dims if isinstance(dims, tuple) else (dims,) * len(args)


def _loop_with_shared(f: Any, mapped: list[Any], shared: list[Any]) -> list[Any]:
    from property_tests.reference import samples

    per = [samples(a) if isinstance(a, raggedfn.Ragged) else list(a.unbind(0)) for a in mapped]
    out = []
    for i in range(len(per[0])):
        it = iter(p[i] for p in per)
        out.append(f(*(s if s is not None else next(it) for s in shared)))
    return out


def test_flat_preparation_defers_errors_to_the_general_path():
    x = tokens((2, 1))
    with pytest.raises(RaggedError, match="disagree on the batch size"):
        raggedfn.map(lambda t, u: t, x, tokens((1, 1, 1)))
    with pytest.raises(RaggedError, match="0-d tensor"):
        raggedfn.map(lambda t, u: t, x, torch.tensor(1.0))
    with pytest.raises(RaggedError, match="no argument is mapped"):
        raggedfn.map(lambda t: t, x, in_dims=None)
    assert _lookup._prepare_flat("map", (x, torch.ones(2)), (0, 0)) is not None
    assert _lookup._prepare_flat("map", (x, torch.ones(3)), (0, 0)) is None


def test_output_without_the_constructor_checks_still_refuses_a_malformed_result():
    x = tokens((2, 1))
    struct = Struct(x.sizes, x.offsets, 3)
    ctx = Ctx(2, {}, {}, x.values.device)
    good = _fallback.to_output(ctx, RaggedB(x.values, x.layout, (), struct))
    assert isinstance(good, raggedfn.Ragged) and good.values is x.values
    assert good.offsets is x.offsets and good.sizes is x.sizes
    # values of another rank than the layout declares (a rule's bug): Ragged() refuses
    with pytest.raises(RaggedError, match="dense axes"):
        _fallback.to_output(ctx, RaggedB(x.values[:, 0], x.layout, (), struct))
    with pytest.raises(RaggedError, match="dense axes"):
        _fallback.to_output(ctx, RaggedB(x.values[..., None], x.layout, (), struct))
