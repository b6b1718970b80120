"""Issue #21: captured tensors are inputs of the trace, so training loops never retrace.

A functional training loop rebinds its parameters at every step and switches
``train()``/``eval()`` between epochs; ``raggedfn.map`` traces once per distinct
Python state and input signature, reads the captured tensors afresh at every
call, and equals the per-sample loop in values and gradients at every step.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop, samples
from raggedfn._map.caching import _cache, _warm
from raggedfn._map.tracing import _signature
from tests.test_map import D, tokens, weights


def test_rebinding_captured_tensors_for_50_steps_traces_once():
    x = tokens((3, 0, 5, 1), seed=4)
    w = weights(D, 4, seed=5).requires_grad_()
    b = weights(4, seed=6).requires_grad_()

    def loss_of(f):
        out = raggedfn.map(f, x)
        return out.pow(2).sum()

    for step in range(50):
        f = lambda t: torch.tanh(t @ w + b).sum(0)  # noqa: E731, B023 (as users write it)
        loss = loss_of(f)
        gw, gb = torch.autograd.grad(loss, (w, b))
        if step % 10 == 0:  # values and gradients equal the loop's
            want = sum(o.pow(2).sum() for o in loop(f, x))
            torch.testing.assert_close(loss, want)
            ww, wb = torch.autograd.grad(want, (w, b))
            torch.testing.assert_close(gw, ww)
            torch.testing.assert_close(gb, wb)
        with torch.no_grad():  # out-of-place update: new tensors every step
            w = (w - 0.1 * gw).requires_grad_()
            b = (b - 0.1 * gb).requires_grad_()
    info = raggedfn.map_cache_info(f)
    assert info.traces == 1, info
    assert info.hits == 49, info


def test_torch_func_grad_through_a_captured_tensor_equals_the_loop():
    x = tokens((2, 4, 0), seed=7)
    w = weights(D, 3, seed=8)

    def loss(w):
        return raggedfn.map(lambda t: F.gelu(t @ w).mean(0), x).pow(2).sum()

    def loop_loss(w):
        return sum(o.pow(2).sum() for o in loop(lambda t: F.gelu(t @ w).mean(0), x))

    for scale in (1.0, -0.5, 2.0):
        torch.testing.assert_close(
            torch.func.grad(loss)(w * scale), torch.func.grad(loop_loss)(w * scale)
        )


def test_load_state_dict_that_replaces_parameters_traces_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    model = model.double()
    x = tokens((3, 2, 6), seed=9)
    f = lambda t: model(t).sum(0)  # noqa: E731
    before = raggedfn.map_cache_info(f).traces
    for seed in range(4):
        other = torch.nn.Sequential(
            torch.nn.Linear(D, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)
        ).double()
        torch.nn.init.normal_(other[0].weight, generator=torch.Generator().manual_seed(seed))
        model.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects
        assert_same(raggedfn.map(f, x), loop(f, x))
    assert raggedfn.map_cache_info(f).traces == before + 1


def test_train_eval_switches_trace_at_most_twice_in_ten():
    torch.manual_seed(1)
    layer = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Dropout(0.3)).double()
    x = tokens((4, 1, 3), seed=10)

    def f(t):
        return layer(t).sum(0)

    for epoch in range(10):
        layer.train(epoch % 2 == 0)
        out = raggedfn.map(f, x)
        if not layer.training:
            assert_same(out, loop(f, x))
    assert raggedfn.map_cache_info(f).traces == 2


def test_the_cache_stays_bounded_and_counts_evictions():
    x = tokens((2, 3))

    def make(power):
        return lambda t: t.pow(power).sum(0)

    first = make(0)
    for power in range(_cache.MAX_VARIANTS + 3):  # a new Python number each time
        raggedfn.map(make(power), x)
    info = raggedfn.map_cache_info(first)
    assert info.variants == _cache.MAX_VARIANTS
    assert info.evictions == 3
    assert info.traces == _cache.MAX_VARIANTS + 3


def test_the_ragged_signature_memo_stays_bounded_and_its_dropped_entries_still_work(
    monkeypatch,
):
    """A ragged leaf's signature entry is memoized by (layout, dtype, dense shape,
    device) in a table emptied when full: it never holds more than its bound, and a
    leaf whose entry was dropped gets the same signature again, so its plan is found
    (no new trace) and the result still equals the loop."""
    bound = 3
    monkeypatch.setattr(_signature, "MAX_RAGGED_SIGNATURES", bound)
    table: dict = {}
    monkeypatch.setattr(_signature, "_RAGGED_SIGNATURES", table)
    # every call through the general lookup (the warm path skips the signature)
    monkeypatch.setattr(_warm, "call", lambda *args, **kwargs: _warm.MISS)

    def f(t):
        return t * t.shape[-1] + 1

    xs = [tokens((2, 0, 3), dim=width, seed=width) for width in range(1, 8)]

    def written_out(x):  # the entry, spelled out from the value
        return ("R", ((True, 0), (False, 0)), str(x.dtype), (x.values.shape[-1],), "cpu")

    for x in xs:  # seven keys through a table of three
        assert _signature.signature([x], ["ragged"]) == (written_out(x),)
        assert 1 <= len(table) <= bound
        assert_same(raggedfn.map(f, x), loop(f, x))
        assert len(table) <= bound
    first = xs[0]
    assert (first.layout.code, first.dtype, first.values.shape[1:], first.device) not in table
    traces = raggedfn.map_cache_info(f).traces
    assert traces == len(xs)
    for x in xs:  # again: the dropped entries come back equal, every plan is found
        assert _signature.signature([x], ["ragged"]) == (written_out(x),)
        assert_same(raggedfn.map(f, x), loop(f, x))
        assert len(table) <= bound
    assert raggedfn.map_cache_info(f).traces == traces


def test_a_tuple_argument_and_a_bare_one_do_not_share_a_plan():
    """``map(f, x)`` takes the flat-argument shortcut, ``map(f, (x,))`` the pytree
    flatten: the same leaves and signature, but other tree specs, so each call gets its
    own plan; so do values of another dtype or dense shape."""

    def f(t):
        return t[0] * 2 if isinstance(t, tuple) else t * 3

    x = tokens([2, 0, 3])
    for _ in range(2):  # and again, from the cache
        assert torch.equal(raggedfn.map(f, x).values, x.values * 3)
        assert torch.equal(raggedfn.map(f, (x,)).values, x.values * 2)
        shared = raggedfn.map(lambda t, w: t * w, x, torch.full((D,), 5.0), in_dims=(0, None))
        assert torch.equal(shared.values, x.values * 5)
        for other in (x, tokens([2, 0, 3], dtype=torch.float32), tokens([2, 0, 3], dim=D + 1)):
            out = raggedfn.map(scaled, other)  # the width is baked into the trace
            width = other.values.shape[-1]
            assert out.dtype == other.dtype and torch.equal(out.values, other.values * width)
        turned = raggedfn.transpose(x, 1, 2)  # the same values, another layout: t * N
        for got, sample in zip(
            raggedfn.unbind(raggedfn.map(scaled, turned)), raggedfn.unbind(turned), strict=True
        ):
            assert torch.equal(got, sample * sample.shape[-1])


def scaled(t):
    return t * t.shape[-1]


class _Owner:
    """An object in a reference cycle, which a trace's check compares by identity (so
    the trace keeps it alive), as FSDP2's state is reached through its hooks."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.me = self


def _owned_layer() -> tuple[Callable[[torch.Tensor], torch.Tensor], weakref.ref[_Owner]]:
    owner = _Owner(torch.nn.Linear(3, 3))

    def f(t: torch.Tensor) -> torch.Tensor:
        return owner.layer(t).sum(0)

    return f, weakref.ref(owner)


def test_map_cache_clear_frees_what_f_read_and_the_next_call_traces_again() -> None:
    torch.manual_seed(0)
    x = raggedfn.from_list([torch.randn(2, 3), torch.randn(4, 3)])
    f, ref = _owned_layer()
    layer = ref().layer  # type: ignore[union-attr]
    expected = torch.stack([layer(x[i]).sum(0) for i in range(2)])
    torch.testing.assert_close(raggedfn.map(f, x), expected)
    assert raggedfn.map_cache_info(f).traces == 1
    raggedfn.map_cache_clear()
    assert raggedfn.map_cache_info(f) == raggedfn.CacheInfo(0, 0, 0, 0, 0)
    torch.testing.assert_close(raggedfn.map(f, x), expected)  # traced again, same answer
    assert raggedfn.map_cache_info(f).traces == 1
    del f, layer
    raggedfn.map_cache_clear()
    gc.collect()
    assert ref() is None


# registered before raggedfn is imported, so it runs after raggedfn's own exit handler
_AT_EXIT = """
import atexit, gc, weakref
atexit.register(lambda: print("alive at exit:", ref() is not None, flush=True))
import torch, raggedfn
from tests.test_map_cache import _owned_layer
f, ref = _owned_layer()
raggedfn.map(f, raggedfn.from_list([torch.randn(2, 3), torch.randn(4, 3)]))
del f
gc.collect()
print("alive after del:", ref() is not None, flush=True)
"""


def run_at_exit(script: str) -> str:
    """What a fresh interpreter running ``script`` (from the checkout) prints."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_traces_are_freed_at_exit_before_the_interpreter_is_torn_down() -> None:
    # a gloo group held by FSDP2's state, which a trace kept, aborted the process when
    # it was freed during interpreter finalization
    printed = run_at_exit(_AT_EXIT)
    assert "alive at exit: False" in printed, printed


def test_two_compiled_calls_of_f_on_other_feature_sizes_and_an_eviction_between(
    monkeypatch,
) -> None:
    # two map calls of f in one compiled function, on other feature sizes: two traces
    # (the second was the first's, and its reshape failed); one variant per entry: the
    # second evicts the variant the first read before dynamo builds the graph's guards
    # (an AttributeError inside dynamo, seen in CI with the shared Segment entry of
    # nested map's compiled torch code)
    monkeypatch.setattr(_cache, "MAX_VARIANTS", 1)
    _cache.clear()

    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t).sum(0)

    def step(x: raggedfn.Ragged, y: raggedfn.Ragged) -> torch.Tensor:
        return raggedfn.map(f, x).sum() + raggedfn.map(f, y).sum()

    x = raggedfn.from_list([torch.randn(2, 3), torch.randn(4, 3)])
    y = raggedfn.from_list([torch.randn(3, 5), torch.randn(1, 5)])
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    expected = sum(f(t).sum() for t in [*samples(x), *samples(y)])
    torch.testing.assert_close(compiled(x, y), expected)
    torch.testing.assert_close(compiled(x, y), expected)
