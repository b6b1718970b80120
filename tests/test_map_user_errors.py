"""An exception ``f`` raises inside ``raggedfn.map`` reaches the caller as the loop and
``torch.func.vmap`` raise it: its own type (the very object ``f`` raised), with a note
naming the sample, whichever way map got there (the trace failing on it, a guard
sending a sample to the per-sample loop, the cached path of a later call)."""

from __future__ import annotations

import warnings

import pytest
import torch

import raggedfn
from raggedfn import RaggedError, RaggedPerformanceWarning
from tests.test_map import tokens


class LabelMissing(Exception):
    """A user's own exception class, carrying data of its own."""

    def __init__(self, label: int) -> None:
        super().__init__(f"no label {label}")
        self.label = label


RAISED: list[BaseException] = []


def _loop_error(f, x):
    """What the per-sample loop raises, and for which sample."""
    for i, sample in enumerate(raggedfn.unbind(x)):
        try:
            f(sample)
        except Exception as error:
            return type(error), str(error), i
    raise AssertionError("the loop raised nothing")


def _map_error(f, x, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        try:
            raggedfn.map(f, x, **kwargs)
        except Exception as error:
            return error
    raise AssertionError("map raised nothing")


def _check_like_the_loop(f, x, **kwargs):
    RAISED.clear()
    kind, text, sample = _loop_error(f, x)
    RAISED.clear()
    error = _map_error(f, x, **kwargs)
    assert type(error) is kind and not isinstance(error, RaggedError), repr(error)
    assert str(error) == text
    assert error.__notes__ == [f"raggedfn.map: raised by f for sample {sample}"]
    if RAISED:  # the object f raised, not a copy (its own attributes come along)
        assert error is RAISED[-1]
    return error


def always_key_error(t):
    # the trace itself meets the raise: map falls back to the loop, which raises it
    raise KeyError("vocab")


def key_error_on_a_large_sum(t):
    # data-dependent: the trace cannot decide it, the loop raises for sample 2 only
    if bool(t.sum() > 50):
        error = KeyError(int(t.shape[0]))
        RAISED.append(error)
        raise error
    return t.sum(0)


def own_error_on_an_empty_sample(t):
    # a branch on the length: the plan's guard sends the empty sample (index 2 of the
    # batch, 0 of its group) to the per-sample loop; the others run batched
    if t.shape[0] == 0:
        error = LabelMissing(7)
        RAISED.append(error)
        raise error
    return t.sum(0) * 2


def _big_third():
    x = tokens((2, 3, 4, 1), dtype=torch.float64)
    values = x.values.clone()
    values[5:9] = 100.0  # sample 2's rows
    return x.with_values(values)


@pytest.mark.parametrize(
    ("f", "x"),
    [
        pytest.param(always_key_error, tokens((2, 3)), id="trace-fails"),
        pytest.param(key_error_on_a_large_sum, _big_third(), id="data-dependent"),
        pytest.param(own_error_on_an_empty_sample, tokens((3, 1, 0, 2)), id="guarded-sample"),
    ],
)
def test_f_raises_its_own_exception_naming_the_sample_eager_and_cached(f, x):
    _check_like_the_loop(f, x)
    _check_like_the_loop(f, x)  # the cached (warm) path of the same signature


def test_the_callers_except_catches_it_with_its_data():
    x = tokens((2, 0, 3))
    try:
        raggedfn.map(own_error_on_an_empty_sample, x)
    except LabelMissing as error:
        assert error.label == 7
        assert "raggedfn.map: raised by f for sample 1" in error.__notes__
    else:
        raise AssertionError("map raised nothing")
    with pytest.raises(KeyError, match="vocab"):  # a bare `except KeyError` catches it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RaggedPerformanceWarning)
            raggedfn.map(always_key_error, x)


@pytest.mark.parametrize(
    ("f", "x"),
    [
        pytest.param(lambda t: t.amax(0), tokens((2, 3, 0, 1)), id="amax-of-empty"),
        pytest.param(lambda t: t[torch.tensor([0, 2])], tokens((3, 4, 2)), id="index-past-end"),
        pytest.param(
            lambda t: torch.gather(t, 0, torch.full_like(t[:1], 3).long()),
            tokens((4, 3, 5)),
            id="gather-past-end",
        ),
    ],
)
def test_a_sample_a_batching_rule_finds_torch_refusing_raises_as_the_loop(f, x):
    # the batched rule finds the sample (no other sample's rows are read); the call
    # then runs f per sample for torch's own exception, in map and in map_report,
    # first and cached
    for _ in range(2):
        _check_like_the_loop(f, x)
    kind, text, sample = _loop_error(f, x)
    with pytest.raises(kind) as error:
        raggedfn.map_report(f, x)
    assert str(error.value) == text
    assert error.value.__notes__ == [f"raggedfn.map: raised by f for sample {sample}"]
    ok = raggedfn.map_report(f, tokens((5, 6)))  # a batch torch accepts: batched
    assert ok.fully_batched, str(ok)


def test_inside_torch_compile_without_fullgraph_f_raises_its_own_exception():
    # f's trace fails while dynamo compiles: the graph breaks around map, which runs
    # eagerly, and the loop raises f's own exception (under fullgraph=True dynamo
    # reports any exception as its Unsupported, for the plain loop too)
    def step(x):
        return raggedfn.map(always_key_error, x).sum() * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", dynamic=True)
    with pytest.raises(KeyError, match="vocab") as error, warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        compiled(tokens((2, 3)))
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 0"]


def test_map_refuses_its_own_misuse_with_ragged_error():
    # what is map's own (bad arguments, strict=True refusing the loop) stays RaggedError
    with pytest.raises(RaggedError, match="in_dims entries"):
        raggedfn.map(always_key_error, tokens((2, 3)), in_dims=1)
    with pytest.raises(RaggedError, match="strict=True refuses"):
        raggedfn.map(key_error_on_a_large_sum, _big_third(), strict=True)
