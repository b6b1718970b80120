"""Eager ``map`` over nested values reuses the record of ``f`` across calls.

A warm call does not run ``f`` at all (counted with an ``itertools.count``, a library
object the dependency check compares by identity, so counting changes nothing it
reads). Whatever the record depends on gives a new record, or the cold path, and
the per-document loop's answer: ``module.training``, a captured number, a captured
tensor rebound or changed in place (read afresh, no new record), a new feature width,
grad mode, ``requires_grad``, autocast, ``torch.func`` transforms, a value read from a
tensor's data.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import raggedfn
from raggedfn._map.entry import _eager_nested
from tests.test_map_cache import run_at_exit

SHAPE = [[2, 3], [], [1], [0, 4, 2], [3]]


def _documents(dim: int = 3, seed: int = 0) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    docs = [[torch.randn(n, dim, generator=gen, dtype=torch.float64) for n in doc] for doc in SHAPE]
    return raggedfn.from_list(docs)


def _loop(f: Callable[..., Any], x: raggedfn.Ragged, *shared: Any) -> torch.Tensor:
    return torch.stack([f(x[i], *shared) for i in range(x.batch_size)])


def _map(f: Callable[..., Any], x: raggedfn.Ragged, *shared: Any) -> Any:
    return raggedfn.map(f, x, *shared, in_dims=(0,) + (None,) * len(shared))


CALLS = itertools.count()
_SEEN = [0]


def _calls() -> int:
    """How many times ``f`` ran since the last look."""
    now = next(CALLS)
    ran, _SEEN[0] = now - _SEEN[0], now + 1
    return ran


@pytest.fixture(autouse=True)
def _cold() -> None:
    raggedfn.map_cache_clear()
    _calls()


SCALE = 2.0


def encode(doc: raggedfn.Ragged, w: torch.Tensor) -> torch.Tensor:
    next(CALLS)
    h = raggedfn.apply(torch.tanh, raggedfn.linear(doc, w))  # (S, L*, D)
    s = raggedfn.sum(h, 1)  # [S, D]
    return (torch.softmax(s @ w.t()[0] * SCALE, 0).unsqueeze(-1) * s).sum(0)


def _weight(dim: int = 3, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(dim, dim, generator=gen, dtype=torch.float64)


def test_a_warm_call_does_not_run_f_and_equals_the_loop() -> None:
    x, w = _documents(), _weight()
    hits = _eager_nested.STATS["hits"]
    first = _map(encode, x, w)
    assert _calls() == 1  # recorded once, on the stand-ins
    second = _map(encode, x, w)
    assert _calls() == 0 and _eager_nested.STATS["hits"] == hits + 1
    expected = _loop(encode, x, w)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    other = _documents(seed=5)  # other data, the same record
    torch.testing.assert_close(_map(encode, other, w), _loop(encode, other, w))


def test_a_warm_call_gives_the_loop_gradients() -> None:
    x, w = _documents(), _weight().requires_grad_(True)
    _map(encode, x, w)
    assert _calls() == 1
    values = x.values.clone().requires_grad_(True)
    got = _map(encode, x.with_values(values), w)
    assert _calls() == 1  # the input now requires grad: one new record
    got = _map(encode, x.with_values(values), w)
    assert _calls() == 0
    grads = torch.autograd.grad(got.pow(2).sum(), [values, w])
    expected = _loop(encode, x.with_values(values), w)
    want = torch.autograd.grad(expected.pow(2).sum(), [values, w])
    for g, e in zip(grads, want, strict=True):
        torch.testing.assert_close(g, e)


def test_a_captured_number_changed_records_again() -> None:
    global SCALE
    x, w = _documents(), _weight()
    _map(encode, x, w)
    _calls()
    try:
        SCALE = 3.0
        got = _map(encode, x, w)
        assert _calls() == 1
        torch.testing.assert_close(got, _loop(encode, x, w))
    finally:
        SCALE = 2.0


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, doc: raggedfn.Ragged) -> torch.Tensor:
        next(CALLS)
        s = raggedfn.sum(doc, 1)
        s = self.proj(s)
        return (s * 2 if self.training else s + 1).sum(0)


def _check(f: Callable[..., Any], x: raggedfn.Ragged, *shared: Any, runs: int) -> None:
    """``map`` runs ``f`` ``runs`` times (0: the record reused) and equals the loop."""
    got = _map(f, x, *shared)
    assert _calls() == runs
    torch.testing.assert_close(got, _loop(f, x, *shared))
    _calls()


def test_module_training_a_rebound_and_an_in_place_changed_weight() -> None:
    x, head = _documents(), Head()
    _check(head, x, runs=1)
    _check(head, x, runs=0)
    head.eval()
    _check(head, x, runs=1)  # a new record for eval mode
    _check(head, x, runs=0)
    head.train()
    _check(head, x, runs=0)  # the record for training mode is kept
    with torch.no_grad():
        head.proj.weight.mul_(-2)
    _check(head, x, runs=0)  # read afresh: no new record
    head.proj.weight = nn.Parameter(torch.ones(3, 3, dtype=torch.float64))  # rebound
    _check(head, x, runs=0)


def test_a_rebound_captured_tensor_and_a_made_one_are_read_afresh() -> None:
    x = _documents()
    w = _weight()

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        next(CALLS)
        v = w.t()[0]  # made from the captured tensor by torch code in f
        return (raggedfn.sum(raggedfn.linear(doc, w), 1) @ v).exp().sum(0)

    _check(f, x, runs=1)
    with torch.no_grad():
        w.add_(1.5)
    _check(f, x, runs=0)
    w = _weight(seed=7)  # the closure cell rebound
    _check(f, x, runs=0)
    w = _weight(dim=4)[:3, :3]  # not contiguous: the same record
    _check(f, x, runs=0)
    w = w.float()  # another dtype: the check refuses, a new record
    x = x.with_values(x.values.float())
    _check(f, x, runs=1)


def test_a_new_feature_width_and_grad_mode_record_again() -> None:
    x, w = _documents(), _weight()
    _check(encode, x, w, runs=1)
    x4, w4 = _documents(dim=4), _weight(dim=4)
    _check(encode, x4, w4, runs=1)
    _check(encode, x, w, runs=0)
    with torch.no_grad():
        _check(encode, x, w, runs=1)  # a new record for no_grad
        _check(encode, x, w, runs=0)
    w.requires_grad_(True)
    _check(encode, x, w, runs=1)  # a shared argument that requires grad


def test_autocast_and_torch_func_take_the_cold_path() -> None:
    x, w = _documents(), _weight().float()
    x = x.with_values(x.values.float())
    _check(encode, x, w, runs=1)
    for _ in range(2):  # recorded anew at every call
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _map(encode, x, w)
            assert _calls() == 1
            expected = _loop(encode, x, w)
        assert got.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(got, expected)
        _calls()

    def loss(w: torch.Tensor) -> torch.Tensor:
        return _map(encode, x, w).pow(2).sum()

    for scale in (1.0, 2.0):
        got = torch.func.grad(loss)(w * scale)
        assert _calls() == 1  # recorded under the transform, at every call
        expected = torch.func.grad(lambda w: _loop(encode, x, w).pow(2).sum())(w * scale)
        torch.testing.assert_close(got, expected)
        _calls()


def test_a_value_read_from_a_tensor_s_data_is_never_stale() -> None:
    x = _documents()
    scale = torch.tensor(2.0, dtype=torch.float64)

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        next(CALLS)
        return raggedfn.sum(doc, 1).sum(0) * float(scale)  # a Python number of the moment

    _check(f, x, runs=2)  # the kept record cannot stand for f: recorded the old way too
    scale.fill_(5.0)
    _check(f, x, runs=1)  # the old way only (the failure is kept), with the new value


class Seen(torch.overrides.TorchFunctionMode):
    """Notes the torch functions called (a user's mode sees every torch call of ``f``:
    nested map runs the loop under it, see ``test_map_nested_batched``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_runs_the_loop_and_not_the_kept_record() -> None:
    x, w = _documents(), _weight()

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        next(CALLS)
        return torch.tanh(raggedfn.sum(doc, 1) @ w).sum(0)

    _check(f, x, runs=1)
    with Seen() as seen:
        with pytest.warns(raggedfn.RaggedPerformanceWarning, match="torch function mode"):
            got = _map(f, x)
        assert _calls() == x.offsets.shape[0] - 1  # once per document: the loop
    assert "tanh" in seen.names
    torch.testing.assert_close(got, _loop(f, x))
    _calls()
    _check(f, x, runs=0)


def _owned_head() -> tuple[Callable[[raggedfn.Ragged], torch.Tensor], Any]:
    from tests.test_map_cache import _Owner

    owner = _Owner(nn.Linear(3, 3, dtype=torch.float64))

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        return owner.layer(raggedfn.sum(doc, 1)).sum(0)

    return f, weakref.ref(owner)


def test_map_cache_clear_frees_what_a_kept_record_read() -> None:
    x = _documents()
    f, ref = _owned_head()
    torch.testing.assert_close(_map(f, x), _loop(f, x))
    _map(f, x)
    del f
    gc.collect()
    assert ref() is not None  # kept by the record's check
    raggedfn.map_cache_clear()
    gc.collect()
    assert ref() is None


# registered before raggedfn is imported, so it runs after raggedfn's own exit handlers
_AT_EXIT = """
import atexit, gc
atexit.register(lambda: print("alive at exit:", ref() is not None, flush=True))
import raggedfn
from tests.test_nested_map_warm import _documents, _owned_head
f, ref = _owned_head()
raggedfn.map(f, _documents())
del f
gc.collect()
print("alive after del:", ref() is not None, flush=True)
"""


def test_kept_records_are_freed_at_exit() -> None:
    printed = run_at_exit(_AT_EXIT)
    assert "alive after del: True" in printed, printed
    assert "alive at exit: False" in printed, printed


def test_an_op_of_a_kept_record_that_refuses_the_batch_runs_the_loop() -> None:
    x, w = _documents(), _weight()
    _check(encode, x, w, runs=1)
    (program,) = next(iter(_eager_nested._INDEX.values()))
    k, step = next((k, s) for k, s in enumerate(program.steps) if s.node is not None)

    def refuses(*args: Any, **kwargs: Any) -> Any:
        raise raggedfn.RaggedError("refused")

    refuses.__name__ = step.node.fn.__name__
    steps = list(program.steps)
    steps[k] = step._replace(node=step.node._replace(fn=refuses))
    program.steps = tuple(steps)
    with pytest.warns(raggedfn.RaggedPerformanceWarning, match="on the batch: refused"):
        got = _map(encode, x, w)
    assert _calls() == 5  # the loop
    torch.testing.assert_close(got, _loop(encode, x, w))


class Box:
    """A pytree node whose context (a list) cannot be hashed (its tree spec can)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


torch.utils._pytree.register_pytree_node(
    Box, lambda b: ([b.w], ["w"]), lambda leaves, context: Box(leaves[0])
)


def test_a_pytree_node_with_an_unhashable_context_reuses_the_record() -> None:
    x, box = _documents(), Box(_weight())

    def f(doc: raggedfn.Ragged, box: Box) -> torch.Tensor:
        next(CALLS)
        return raggedfn.sum(raggedfn.linear(doc, box.w), 1).sum(0)

    _check(f, x, box, runs=1)
    _check(f, x, box, runs=0)
    _check(f, x, Box(_weight(seed=3)), runs=0)  # another box: its tensor read afresh


def test_a_shared_number_changed_records_again() -> None:
    x = _documents()

    def f(doc: raggedfn.Ragged, scale: float) -> torch.Tensor:
        next(CALLS)
        return raggedfn.sum(doc, 1).sum(0) * scale

    _check(f, x, 2.0, runs=1)
    _check(f, x, 2.0, runs=0)
    _check(f, x, 3.0, runs=1)  # a constant of the record
    _check(f, x, 3, runs=1)  # another type
