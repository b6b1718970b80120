"""raggedfn.map is the per-sample loop or a RaggedError: never a stale or wrong answer.

Issue #12's cases: Python state the trace reads (module ``training`` flags, numbers,
object attributes), empty samples and static slices, in-place writes, randomness,
data-dependent sizes, output types, nested map and threads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop, samples
from raggedfn import RaggedError, RaggedPerformanceWarning
from tests.test_map import D, tokens

quiet = pytest.mark.filterwarnings("ignore::raggedfn.RaggedPerformanceWarning")


# ----- Python state the trace depends on ------------------------------------------------


def _equal_to_loop(f, x, *shared):
    dims = (0, *([None] * len(shared)))
    out = raggedfn.map(f, x, *shared, in_dims=dims)
    assert_same(out, loop(f, x, *shared))
    return out


def test_train_eval_toggles_through_a_closure_and_functional_call():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Dropout(0.5)).double()
    params = dict(layer.named_parameters())
    x = tokens((3, 0, 4))

    def closure(t):
        return layer(t).sum(0)

    def functional(t, p):
        return torch.func.functional_call(layer, p, (t,)).sum(0)

    for f, shared in ((closure, ()), (functional, (params,))):
        layer.eval()
        _equal_to_loop(f, x, *shared)
        layer.train()  # dropout now draws: no sample equals its eval value any more
        out = raggedfn.map(f, x, *shared, in_dims=(0, *([None] * len(shared))))
        layer.eval()
        evaluated = loop(f, x, *shared)
        assert not torch.allclose(out[0], evaluated[0])
        _equal_to_loop(f, x, *shared)  # back in eval: the eval trace again, no dropout


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(D, 3).double()
        self.temperature = 1.0

    def forward(self, t):
        return (self.linear(t) / self.temperature).softmax(0)


def test_a_changed_module_float_attribute_is_seen():
    model = Scaled()
    x = tokens((3, 5))
    _equal_to_loop(model, x)
    model.temperature = 0.25
    _equal_to_loop(model, x)
    _equal_to_loop(lambda t: model(t).sum(0), x)
    model.temperature = 4.0
    _equal_to_loop(lambda t: model(t).sum(0), x)


SCALE = 2.0
CONFIG = types.SimpleNamespace(shift=1.0)


def uses_global_number(t):
    return t * SCALE + CONFIG.shift


def test_a_rebound_global_number_and_a_changed_object_attribute_are_seen():
    global SCALE
    x = tokens((2, 3))
    _equal_to_loop(uses_global_number, x)
    old = SCALE
    try:
        SCALE = -3.0
        _equal_to_loop(uses_global_number, x)
        CONFIG.shift = 7.0
        _equal_to_loop(uses_global_number, x)
    finally:
        SCALE, CONFIG.shift = old, 1.0
    _equal_to_loop(uses_global_number, x)


def helper_reading_a_global(t):
    return t - SCALE


def test_a_global_read_by_a_called_user_function_is_seen():
    global SCALE
    x = tokens((2, 3))
    f = lambda t: helper_reading_a_global(t) * 2  # noqa: E731
    _equal_to_loop(f, x)
    old = SCALE
    try:
        SCALE = 11.0
        _equal_to_loop(f, x)
    finally:
        SCALE = old


def test_closure_numbers_and_defaults_are_part_of_the_trace():
    x = tokens((2, 4))

    def make(k):
        def f(t, power=2):
            return t.pow(power) * k

        return f

    _equal_to_loop(make(2.0), x)
    _equal_to_loop(make(5.0), x)
    g = make(5.0)
    g.__defaults__ = (3,)
    _equal_to_loop(g, x)


def test_a_module_passed_as_a_shared_argument_is_guarded_and_lifted():
    model = torch.nn.Linear(D, 2).double()
    x = tokens((3, 1))

    def f(t, m):
        return m(t).sum(0)

    _equal_to_loop(f, x, model)
    model.weight = torch.nn.Parameter(model.weight.detach() * -2)
    _equal_to_loop(f, x, model)
    assert raggedfn.map_cache_info(f).traces == 1


# ----- empty samples, slices and indexing ------------------------------------------------


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t[:1],
        lambda t: t[0:1],
        lambda t: t[-1:],
        lambda t: t.narrow(0, 0, min(1, t.shape[0])),
        lambda t: t[:1].sum(0),
        lambda t: t[-1:].mean(0) if t.shape[0] > 0 else t.sum(0),
        lambda t: t[:-1].shape[0],
        lambda t: t[2:-2],
        lambda t: t[1:-1][1:-1],
        lambda t: t[::2].shape[0],
        lambda t: t[::3] * 2,
        lambda t: torch.cat([torch.zeros_like(t[:1]), t[:-1]], 0),
        lambda t: torch.cat([t, t], 0)[:2],
        lambda t: F.rms_norm(t, (D,))[:2],
        lambda t: t.sum(0) + 1 if t.shape[0] > 0 else t.sum(0) - 1,
        lambda t: t.sum(0) + 1 if t.shape[0] == 0 else t.sum(0) - 1,
        lambda t: t.sum(0) + 1 if t.numel() > 0 else t.sum(0) - 1,
        lambda t: torch.zeros(D, dtype=t.dtype) if t.shape[0] == 0 else t.amax(0),
    ],
)
@pytest.mark.parametrize("lengths", [(2, 0, 3), (2, 3, 0), (0, 0), (1, 4, 6, 8)])
@quiet
def test_slices_and_size_branches_equal_the_loop_on_empty_and_short_samples(f, lengths):
    x = tokens(lengths)
    out = raggedfn.map(f, x)
    expected = loop(f, x)
    if isinstance(expected[0], int):
        assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
        assert out.tolist() == expected
        return
    assert_same(out, expected)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t[:1] * t,
        lambda t: t + t[-1:],
        lambda t: (t - t[:1]).sum(0),
        lambda t: torch.where(t[:1] > 0, t, t[-1:]),
    ],
)
@pytest.mark.parametrize("lengths", [(3, 5, 2), (2, 0, 3), (1, 1), (0, 0), (1, 4, 6, 8)])
@quiet
def test_a_slice_of_one_row_broadcasts_against_the_rows_batched(f, lengths):
    """``t[:1]`` has Min(1, N) rows: reasoned about obliviously it cannot broadcast
    against N rows and the trace failed (the whole call per sample). It is traced again
    on the example's sizes, every decision a guard checked per sample: batched, equal to
    the loop in values and gradients, empty and one-row samples included."""
    values = torch.randn(sum(lengths), D, dtype=torch.float64, requires_grad=True)
    x = raggedfn.from_lengths(values * 1, torch.tensor(lengths))
    report = raggedfn.map_report(f, x)
    assert report.whole_loop is None, report.whole_loop
    out = raggedfn.map(f, x)
    want = loop(f, x)
    assert_same(out, want)
    got_values = out.values if isinstance(out, raggedfn.Ragged) else out
    want_values = torch.cat([w.reshape(-1) for w in want])
    weights = torch.arange(1.0, want_values.numel() + 1, dtype=torch.float64)
    if want_values.numel():
        (g,) = torch.autograd.grad(got_values.reshape(-1) @ weights, values, retain_graph=True)
        (e,) = torch.autograd.grad(want_values @ weights, values)
        torch.testing.assert_close(g, e)


def test_output_structure_is_decided_by_f_not_by_this_batch():
    def untraceable(t):  # data-dependent control flow: the whole loop
        return t * 2 if bool(t.sum() > -1e9) else t

    equal, unequal = tokens((3, 3)), tokens((3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        for x in (equal, unequal):
            assert isinstance(raggedfn.map(untraceable, x), raggedfn.Ragged)
            assert isinstance(raggedfn.map(lambda t: t[:2], x), raggedfn.Ragged)
            pooled = raggedfn.map(lambda t: untraceable(t).sum(0), x)
            assert isinstance(pooled, torch.Tensor) and pooled.shape == (2, D)


def test_per_sample_numbers_restack_to_tensors_whatever_their_values():
    x = tokens((12, 12))
    sizes = raggedfn.map(lambda t: t[:2].shape[0], x)
    assert isinstance(sizes, torch.Tensor) and sizes.tolist() == [2, 2]
    columns = raggedfn.map(lambda t: t.shape[1], x)
    assert isinstance(columns, torch.Tensor) and columns.tolist() == [D, D]
    out = raggedfn.map(lambda t: (t.sum(0), 0.5, True), x)
    assert out[1].tolist() == [0.5, 0.5] and out[1].dtype == torch.get_default_dtype()
    assert out[2].tolist() == [True, True]
    with pytest.warns(RaggedPerformanceWarning):
        fallback = raggedfn.map(lambda t: (t.sum(0), 0.5) if t.sum() > -1e9 else None, x)
    assert fallback[1].tolist() == [0.5, 0.5]


def test_bool_reductions_count_as_torch():
    x = tokens((3, 5, 0))
    for f in (lambda t: (t > 0).sum(0), lambda t: (t > -100).sum(0), lambda t: (t > 0).sum()):
        out = raggedfn.map(f, x)
        assert out.dtype == torch.int64
        assert_same(out, loop(f, x))


# ----- in-place writes -------------------------------------------------------------------


def _snapshot(x):
    return x.values._version, x.values.clone()


@quiet
@pytest.mark.parametrize(
    "f",
    [
        lambda t: t.add_(1).sum(0),
        lambda t: t.relu_() * 2,
        lambda t: t[0].zero_() if t.shape[0] else t.sum(0),
        lambda t: torch.nn.functional.relu(t, inplace=True).sum(0),
    ],
)
def test_in_place_writes_never_reach_the_callers_values(f):
    x = tokens((2, 3, 1))
    version, before = _snapshot(x)
    expected = loop(f, raggedfn.from_list([s.clone() for s in samples(x)]))
    assert_same(raggedfn.map(f, x), expected)
    assert x.values._version == version and torch.equal(x.values, before)


def test_in_place_writes_to_a_shared_argument_happen_once_per_sample():
    x = tokens((2, 3, 1))
    counter = torch.zeros(1, dtype=torch.float64)

    def f(t, c):
        c.add_(1)
        return t.sum(0) + c

    looped = torch.zeros(1, dtype=torch.float64)
    expected = [f(s, looped) for s in samples(x)]
    with pytest.warns(RaggedPerformanceWarning, match="writes into an argument"):
        out = raggedfn.map(f, x, counter, in_dims=(0, None))
    assert_same(out, expected)
    assert counter.item() == 3


@quiet
def test_in_place_writes_to_a_captured_tensor_happen_once_per_sample():
    x = tokens((2, 3))
    state = torch.zeros(1, dtype=torch.float64)
    raggedfn.map(lambda t: t.sum(0) + state.add_(1), x)
    assert state.item() == 2


# ----- randomness --------------------------------------------------------------------------


def test_random_draws_are_per_sample_by_default():
    x = tokens((3, 3, 3))
    noise = raggedfn.map(lambda t: t * 0 + torch.rand(D, dtype=t.dtype), x)
    assert not torch.equal(noise.values[:3], noise.values[3:6])
    torch.testing.assert_close(noise.values[0], noise.values[1])  # one draw per sample
    dense = raggedfn.map(lambda t: torch.randn(4), x)
    assert dense.shape == (3, 4) and not torch.equal(dense[0], dense[1])


def test_randomness_same_shares_one_draw_and_error_refuses():
    x = tokens((2, 2))
    same = raggedfn.map(lambda t: t.sum(0) * 0 + torch.rand(D, dtype=t.dtype), x, randomness="same")
    torch.testing.assert_close(same[0], same[1])
    with pytest.raises(RaggedError, match="randomness='error'"):
        raggedfn.map(lambda t: t + torch.rand(D, dtype=t.dtype), x, randomness="error")
    with pytest.raises(RaggedError, match="randomness='same'"):
        raggedfn.map(lambda t: F.dropout(t, 0.5), tokens((2, 3)), randomness="same")
    with pytest.raises(RaggedError, match="randomness must be one of"):
        raggedfn.map(lambda t: t, x, randomness="other")


def test_dropout_draws_an_independent_mask_per_sample():
    torch.manual_seed(0)
    x = raggedfn.from_list([torch.ones(50, D, dtype=torch.float64)] * 2)
    out = raggedfn.map(lambda t: F.dropout(t, 0.5), x)
    first, second = samples(out)
    assert not torch.equal(first, second)
    kept = (out.values != 0).double().mean()
    assert 0.35 < kept < 0.65
    torch.testing.assert_close(
        out.values[out.values != 0], torch.full_like(out.values[out.values != 0], 2.0)
    )


# ----- data-dependent sizes --------------------------------------------------------------


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t[t[:, 0] > 0],
        lambda t: t[t[:, 0] > 0].sum(0),
        lambda t: torch.nonzero(t[:, 0] > 0),
        lambda t: torch.masked_select(t, t > 0),
        lambda t: torch.cat([t[t[:, 0] > 0], t[:1]], 0),
    ],
)
def test_data_dependent_sizes_become_a_new_ragged_axis(f):
    x = tokens((4, 0, 6, 1), seed=3)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


@quiet
def test_unique_runs_per_sample_with_its_own_sizes():
    x = raggedfn.from_list(
        [torch.tensor([3, 1, 3]), torch.tensor([2, 2]), torch.tensor([], dtype=torch.int64)]
    )
    assert_same(raggedfn.map(torch.unique, x), loop(torch.unique, x))


# ----- nested map -----------------------------------------------------------------------------


@quiet
def test_map_nested_inside_f_runs_the_outer_loop_correctly():
    x = raggedfn.from_list(
        [torch.randn(n, n, 2, dtype=torch.float64) for n in (2, 3)], ragged_dims=(1, 2)
    )

    def inner(row):
        return row.sum(0)

    def f(p):
        return raggedfn.map(inner, p).sum(0)

    report = raggedfn.map_report(f, x)
    assert report.whole_loop is not None and "nested" in report.whole_loop
    assert_same(report.output, [p.sum((0, 1)) for p in samples(x)])


# ----- threads --------------------------------------------------------------------------------

THREADS = textwrap.dedent(
    """
    import threading, torch, raggedfn
    import torch.nn.functional as F

    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=torch.float64)
    def f(t):
        return F.layer_norm(torch.tanh(t @ w), (8,)).softmax(0).sum(0) * t.shape[0]
    x = raggedfn.from_list([torch.randn(n, 8, dtype=torch.float64) for n in (3, 0, 5, 2)])
    expected = torch.stack([f(t) for t in raggedfn.unbind(x)])
    results, errors = [], []
    barrier = threading.Barrier(4)
    def work():
        try:
            barrier.wait()
            for _ in range(3):
                results.append(raggedfn.map(f, x))
        except BaseException as error:
            errors.append(repr(error))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors
    assert len(results) == 12
    for r in results:
        torch.testing.assert_close(r, expected)
    assert raggedfn.map_cache_info(f).traces == 1, raggedfn.map_cache_info(f)
    assert not torch.fx._symbolic_trace.is_fx_tracing()
    compiled = torch.compile(lambda v: v.sin() * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.ones(3).sin() * 2)
    print("ok")
    """
)


def test_four_threads_on_a_cold_cache_then_compile():
    result = subprocess.run(
        [sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_a_failed_trace_restores_fx_state():
    x = tokens((2, 3))
    with pytest.warns(RaggedPerformanceWarning):
        raggedfn.map(lambda t: t * 2 if bool(t.sum() > 0) else t, x)
    assert not torch.fx._symbolic_trace.is_fx_tracing()


class Hooked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(D, 2).double()
        self.calls = 0
        self.linear.register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.calls += 1


def test_a_module_with_hooks_runs_per_sample_so_its_hooks_run_per_call():
    model = Hooked()
    x = tokens((3, 0, 2))
    with pytest.warns(RaggedPerformanceWarning, match="forward_hooks"):
        out = raggedfn.map(lambda t: model.linear(t).sum(0), x)
    assert model.calls == 3
    assert_same(out, [model.linear(s).sum(0) for s in samples(x)])


# ----- output structure decided by f, never by the batch ------------------------------------

_SHARED = torch.zeros(2, dtype=torch.float64)


def _relu_then_mean(t):
    t.relu_()  # a write into the argument: the loop runs, with the trace's structure
    return t.mean(0)


def _one_row_branch(t):
    return t * 2 + 1 if t.shape[0] == 1 else t - 1


def _pinned_then_cat(t):
    n = len(t) // 2  # len() pins the size: a second trace tells the ragged axes apart
    return torch.cat([t, t * 0.5], 0), n


def _passthrough_after_shared_write(t):
    _SHARED.add_(1)
    return t


def _setitem_then_number(t):
    h = t.clone()
    if h.shape[0] > 0:
        h[0] = h[0] * 3
    return h, float(h.shape[0])


def _pair_norm_branch(t):
    h = t / torch.linalg.vector_norm(t, 2, dim=-1, keepdim=True).clamp_min(0.1)
    return h + 1 if h.shape[1] > 0 else h * 0.5


def _mask_of_empty(t):
    return t[t[:, 0] > 0], torch.nonzero(t[:, 0] > 0)


def _kind(value):
    return [
        isinstance(v, raggedfn.Ragged) for v in (value if isinstance(value, tuple) else (value,))
    ]


@pytest.mark.parametrize(
    ("f", "batches", "pairs"),
    [
        (_relu_then_mean, [(2, 0), (2, 2)], False),
        (_one_row_branch, [(1, 3), (1, 1)], False),
        (_pinned_then_cat, [(2, 1, 2, 0), (0,), (3, 3)], False),
        (_passthrough_after_shared_write, [(0, 1, 3, 0), (0, 0)], False),
        (_setitem_then_number, [(0, 1), (0, 0)], False),
        (_pair_norm_branch, [(1, 0), (1, 1)], True),
        (_mask_of_empty, [(0,), (0, 3, 1)], False),
    ],
    ids=[
        "write-then-mean",
        "branch-on-one",
        "len-then-cat",
        "passthrough",
        "setitem",
        "pairs",
        "mask-empty",
    ],
)
def test_output_kind_follows_f_not_the_batch(f, batches, pairs):
    """Values equal the loop's, and every batch gives the same Ragged/dense kind per output
    (issue #12: output structure is decided by f, never by this batch's lengths)."""
    kinds = set()
    for lengths in batches:
        gen = torch.Generator().manual_seed(len(lengths))
        shapes = [(n, n if n != 1 or not pairs else 0) if pairs else (n,) for n in lengths]
        data = [torch.randn(*s, 2, generator=gen, dtype=torch.float64) for s in shapes]
        x = raggedfn.from_list(data, ragged_dims=(1, 2) if pairs else (1,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RaggedPerformanceWarning)
            got = raggedfn.map(f, x)
        expected = [f(s.clone()) for s in data]
        if isinstance(got, tuple):
            for j, leaf in enumerate(got):
                column = [e[j] for e in expected]
                if isinstance(column[0], torch.Tensor):
                    assert_same(leaf, column)
                else:  # per-sample numbers restack to a [B] tensor
                    assert isinstance(leaf, torch.Tensor) and leaf.tolist() == column
        else:
            assert_same(got, expected)
        kinds.add(tuple(_kind(got)))
    assert len(kinds) == 1, kinds


def test_masked_select_keeps_row_major_order_when_a_fixed_axis_leads():
    """Issue #19 (20,000-program run, seed 1 program 8372): ``t.narrow(0, 0, 2)`` of a pair
    state makes axis 0 fixed and axis 1 ragged; the selection must follow row-major order."""
    gen = torch.Generator().manual_seed(1068433020)
    data = [torch.randn(n, n, 2, generator=gen, dtype=torch.float64) for n in (2, 3)]
    x = raggedfn.from_list(data, ragged_dims=(1, 2))

    def f(t):
        h = t.narrow(0, 0, min(2, t.shape[0]))
        return torch.masked_select(h, h > 0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        got = raggedfn.map(f, x)
    assert_same(got, [f(s.clone()) for s in data])
