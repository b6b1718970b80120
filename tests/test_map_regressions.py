"""Every reproducer of issues #19 (size arithmetic and guards) and #12 (soundness) as
its own test against the per-sample loop.

Samples are random ``[n, 2]``
float64 tensors unless a test says otherwise. ``map`` runs inside
``_quiet`` so that a fallback's performance warning is recorded, not raised.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.map_oracle import assert_restacked
from raggedfn import RaggedError

LAYOUT = raggedfn.Layout.standard(1, 1)


def _samples(lengths, dim=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=gen, dtype=torch.float64) for n in lengths]


def _quiet(f, *args, **kwargs):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        return raggedfn.map(f, *args, **kwargs)


def _same_as_loop(f, lengths, **kwargs):
    samples = _samples(lengths)
    x = raggedfn.from_list(samples)
    got = _quiet(f, x, **kwargs)
    assert_restacked(got, [f(s.clone()) for s in samples])
    return got


# ----- issue 19: silent wrong values ------------------------------------------------------


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(lambda t: (t > 0).sum(0), id="positive"),
        pytest.param(lambda t: (t > -100).sum(0), id="all"),
    ],
)
def test_19_1_bool_sum_over_the_ragged_axis_counts(f):
    _same_as_loop(f, [3, 5])


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(lambda t: t.sum(0) + 1 if t.shape[0] > 0 else t.sum(0) - 1, id="gt0"),
        pytest.param(lambda t: t.sum(0) + 1 if t.shape[0] >= 1 else t.sum(0) - 1, id="ge1"),
        pytest.param(lambda t: t.sum(0) + 1 if t.shape[0] != 0 else t.sum(0) - 1, id="ne0"),
        pytest.param(lambda t: t.sum(0) + 1 if t.shape[0] == 0 else t.sum(0) - 1, id="eq0"),
        pytest.param(lambda t: t.sum(0) + 1 if t.numel() > 0 else t.sum(0) - 1, id="numel"),
        # the torch.zeros(2) mixes float32 and float64 samples; new_zeros keeps one dtype
        pytest.param(lambda t: t.new_zeros(2) if t.shape[0] == 0 else t.amax(0), id="amax"),
    ],
)
def test_19_2_branch_on_a_size_compared_with_zero(f):
    _same_as_loop(f, [0, 2])


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(lambda t: t[:1], id="head"),
        pytest.param(lambda t: t[-1:], id="tail"),
    ],
)
def test_19_3_static_slice_of_an_empty_sample(f):
    _same_as_loop(f, [0, 3])


def test_19_4_size_of_a_slice_is_clamped_at_zero():
    got = _same_as_loop(lambda t: t[:-1].shape[0], [2, 0])
    assert got.tolist() == [1, 0]


@pytest.mark.parametrize(
    ("f", "lengths"),
    [
        pytest.param(lambda t: t[2:-2], [6, 6], id="2:-2"),
        pytest.param(lambda t: t[1:-1][1:-1], [8, 6], id="chained"),
    ],
)
def test_19_5_slice_bounds_are_evaluated_per_sample(f, lengths):
    _same_as_loop(f, lengths)


def test_19_6_step_slice_size_is_a_ceil_division():
    got = _same_as_loop(lambda t: t[::2].shape[0], [1, 4])
    assert got.dtype == torch.int64 and got.tolist() == [1, 2]


def test_19_7_slice_after_a_norm_keeps_its_guard():
    _same_as_loop(lambda t: F.rms_norm(t, (2,))[:2], [1, 3])


def _unused_slice(t):
    _ = t[-1:]
    return t.sum(0)


def _shift_right(t):
    return torch.cat([torch.zeros_like(t[:1]), t[:-1]], 0)


def _norm_then_shift(t):
    h = F.rms_norm(t, (2,))
    return torch.cat([torch.zeros_like(h[:2]), h[:-2]], 0)


@pytest.mark.parametrize(
    ("f", "lengths"),
    [
        pytest.param(lambda t: t[-1:], [3, 0], id="tail-of-empty-last"),
        pytest.param(lambda t: t[:1], [0, 0], id="head-all-empty"),
        pytest.param(_unused_slice, [3, 0], id="unused-slice"),
        pytest.param(lambda t: torch.cat([t, t], 0)[:2], [0], id="cat-then-slice"),
        pytest.param(_shift_right, [0], id="shift-right"),
        pytest.param(
            lambda t: t[(torch.arange(t.shape[0]) + 1) % t.shape[0]],
            [3, 0, 2],
            id="modular",
        ),
        pytest.param(
            lambda t: F.scaled_dot_product_attention(t[1:-1][None], t[None], t[None])[0][1:-1],
            [8, 4],
            id="attention-sliced",
        ),
        pytest.param(_norm_then_shift, [1, 3], id="norm-then-shift"),
    ],
)
def test_19_crashes_where_the_loop_runs(f, lengths):
    _same_as_loop(f, lengths)


@pytest.mark.parametrize(
    ("f", "lengths"),
    [
        pytest.param(lambda t: t[:2].shape[0], [12], id="constant-slice"),
        pytest.param(lambda t: t.shape[1], [3, 2], id="dense-size"),
    ],
)
def test_19_per_sample_sizes_restack_to_a_tensor_whatever_their_values(f, lengths):
    got = _same_as_loop(f, lengths)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64


# ----- issue 19: float32 programs and a group of empty samples ---------------------------


def _attention_3d(h):
    return F.scaled_dot_product_attention(h[None], h[None], h[None], is_causal=True)[0]


@pytest.mark.parametrize("lengths", [[1, 4], [3, 0, 5], [4, 4]])
def test_19_a_three_d_attention_rounds_as_the_loop(lengths):
    """A sample's 3-d SDPA call runs torch's math kernel (the fused ones take 4-d only):
    map runs the same kernel, so float32 values and gradients are the loop's, bit for bit
    (with the fused kernel the gradients differed by ~1e-6, and the random float32
    programs of test_map_props went past their bound)."""

    def f(h):
        return _attention_3d(_attention_3d(h).relu())

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(sum(lengths), 6, generator=gen).requires_grad_()
    x = raggedfn.from_lengths(values, torch.tensor(lengths))
    out = raggedfn.map(f, x, strict=True).values
    (grad,) = torch.autograd.grad((out * out).sum(), values)
    want = torch.cat([f(s) for s in raggedfn.unbind(x)])
    (want_grad,) = torch.autograd.grad((want * want).sum(), values)
    assert torch.equal(out, want)
    assert torch.equal(grad, want_grad)


def test_19_a_group_of_empty_samples_falls_back_per_node_without_a_warning():
    """Samples without elements get a plan of their own (a retrace at size 0), where
    nn.MultiheadAttention's unsqueeze runs per node: that costs nothing, so it neither
    warns (warnings are errors in the suite) nor counts against strict=True."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).double()

    def f(t):
        return mha(t[None], t[None], t[None], need_weights=False)[0][0]

    samples = [torch.randn(n, 8, dtype=torch.float64) for n in (3, 0, 5)]
    x = raggedfn.from_list(samples)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = raggedfn.map(f, x)
        strict = raggedfn.map(f, x, strict=True)
    want = [f(s) for s in samples]
    assert_restacked(got, want)
    assert_restacked(strict, want)


def _dropout_eval_then_add_(t):
    o0 = t  # eager dropout(training=False) returns t itself: add_ writes the input
    h = F.dropout(t, 0.5, training=False)
    h.add_(0.25)
    return h, o0


def _dropout_eval_of_a_fresh_value_then_add_(t):
    h = t * 2
    d = F.dropout(h, 0.5, training=False)
    d.add_(0.25)  # ... and here h
    return h


@pytest.mark.parametrize("f", [_dropout_eval_then_add_, _dropout_eval_of_a_fresh_value_then_add_])
def test_19_an_in_place_op_after_dropout_in_eval_writes_what_the_loop_writes(f):
    """aten.dropout's schema promises a fresh tensor, but its kernel returns the input
    when not training (found by seed 3 of the 20,000-program run, program 4024)."""
    samples = _samples([1, 0, 3])
    x = raggedfn.from_list(samples)
    got = _quiet(f, x)
    assert_restacked(got, [f(s.clone()) for s in samples])
    assert torch.equal(x.values, torch.cat(samples))  # the caller's value is untouched


# ----- issue 19: the 20,000-program run of this session -----------------------------------


def _reshape_then_branch_on_one(t):
    # matmul's reshape decides Ne(n, 1) as layout bookkeeping; it must not decide f's
    # own branch on n == 1 (it stayed a ShapeEnv fact: a silent wrong branch)
    y = t.transpose(0, 1).reshape(-1, 2) @ torch.ones(2, 2, dtype=t.dtype)
    return y.sum() + 1 if t.shape[0] == 1 else y.sum() - 1


def _slice_log_softmax_then_branch_on_numel(t):
    # contiguous() inside log_softmax decided Eq(numel, 0) at the trace's example size
    h = F.log_softmax(t[-1:3:2], -1)
    return h.cumsum(0) if h.numel() > 0 else h + 1


def _attention_then_branch_on_emptiness(t):
    h = F.scaled_dot_product_attention(t[None], t[None], t[None])[0]
    return h.sum() + 1 if h.shape[0] == 0 else h.sum() - 1


@pytest.mark.parametrize(
    ("f", "lengths"),
    [
        pytest.param(_reshape_then_branch_on_one, [1, 4], id="layout-guard-n-1"),
        pytest.param(_slice_log_softmax_then_branch_on_numel, [1, 2, 5], id="layout-numel"),
        pytest.param(_attention_then_branch_on_emptiness, [0, 3], id="attention-empty"),
    ],
)
def test_19_layout_decisions_never_decide_a_branch_of_f(f, lengths):
    _same_as_loop(f, lengths)


def _shape_of_a_pair_sample(lengths):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, n, 2, generator=gen, dtype=torch.float64) for n in lengths]


def test_19_layout_numel_on_a_pair_sample():
    samples = _shape_of_a_pair_sample([1, 1])
    x = raggedfn.from_list(samples, ragged_dims=(1, 2))
    got = _quiet(_slice_log_softmax_then_branch_on_numel, x)
    assert_restacked(got, [_slice_log_softmax_then_branch_on_numel(s.clone()) for s in samples])


def _first_row_after_a_branch(t):
    h = t * 2 + 1 if t.shape[0] > 3 else t - 1
    return h[:1]


def _first_rows_up_to_three(t):
    return t.narrow(0, 0, min(3, t.shape[0]))


def _rows_before_two_of_the_last_then_a_branch_on_data(t):
    # program 1394 of seed 3097554124: no rows for every n >= 3, one at n = 2, where
    # the branch on the selected rows' count stops the small probe
    h = t[-1:2]
    h = h[h[:, 0] > 0]
    return h.cumsum(0) if h.numel() > 0 else h + 1


@pytest.mark.parametrize(
    ("f", "batches", "ragged"),
    [
        # one row whatever n >= 1: the same type for every batch, whichever plans run
        pytest.param(_first_row_after_a_branch, ([7, 3], [7, 7], [2, 3]), True, id="first-row"),
        # min(3, n) rows: fixed for n >= 3 only, so the type is ragged for every batch
        pytest.param(_first_rows_up_to_three, ([5, 6], [0, 3], [1, 2]), True, id="min-3"),
    ],
)
def test_19_output_type_is_decided_by_f_not_by_the_batch(f, batches, ragged):
    for lengths in batches:
        got = _same_as_loop(f, lengths)
        assert isinstance(got, raggedfn.Ragged) == ragged, (lengths, type(got))


def test_19_a_guarded_trace_whose_probe_stops_claims_no_structure():
    """The first trace fixes 0 rows (``n >= 3``) and the probe on 2 rows stops at the
    branch on the data: the structure is unknown (it once kept the first trace's, so
    ``[0, 0]`` gave a dense ``[2, 0, 2]`` where ``[0, 1]`` gave a ``Ragged``), and each
    batch's kinds follow its samples' sizes as docs/map.md's Known limits say."""
    f = _rows_before_two_of_the_last_then_a_branch_on_data
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        report = raggedfn.map_report(f, raggedfn.from_list(_samples([6, 7])))
    assert report.structure is None, report.structure
    # 0 rows, equal to every sample's length: ragged; 0 rows of 6 and 7: dense
    assert isinstance(_same_as_loop(f, [0, 0]), raggedfn.Ragged)
    assert isinstance(_same_as_loop(f, [6, 7]), torch.Tensor)
    _same_as_loop(f, [0, 1])
    _same_as_loop(f, [2, 2, 5])


def _narrow_of_a_selection(t):
    return t[t[:, 0] > 0].narrow(0, 1, 0)


def test_19_a_check_on_a_data_dependent_size_is_made_per_call():
    """torch checks ``1 <= count`` for the narrow while tracing; it used to crash with
    KeyError 'u0' (a guard on a size that exists only once the mask has run)."""
    samples = [torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)] * 2
    x = raggedfn.from_list(samples)
    got = _quiet(_narrow_of_a_selection, x)
    assert_restacked(got, [_narrow_of_a_selection(s.clone()) for s in samples])
    # a sample with nothing selected: the loop's IndexError, for that sample
    bad = raggedfn.from_list([samples[0], -samples[0]])
    with pytest.raises(IndexError, match=r"start out of range") as error:
        _quiet(_narrow_of_a_selection, bad)
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]


def _add_into_the_argument(t):
    t.add_(0.5)
    return t * 2, t.sum(-1)


def test_19_an_empty_batch_of_a_complete_trace_has_its_structure():
    x = raggedfn.from_lengths(
        torch.empty(0, 2, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    )
    out, total = _quiet(_add_into_the_argument, x)
    assert isinstance(out, raggedfn.Ragged) and isinstance(total, raggedfn.Ragged)
    assert out.batch_size == 0 and out.values.shape == (0, 2) and total.values.shape == (0,)


def _head_by_size(t):
    h = t[:1]
    return h * 2 + 1 if t.shape[0] > 2 else h - 1


def test_19_an_empty_batch_of_two_ragged_axes_merges_without_samples():
    """Program 8386 of seed 5: on a batch of no samples of a two-ragged-axis value, the
    output merge read the sizes of a part of no samples (``min()`` of an empty tensor: a
    RuntimeError where the loop runs). The empty result has f's structure; a batch with
    samples still equals the loop."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (1, 2), (0, 3)]
    full = raggedfn.from_list(
        [torch.randn(*s, 2, generator=gen, dtype=torch.float64) for s in shapes],
        ragged_dims=(1, 2),
    )
    empty = full[torch.zeros(0, dtype=torch.int64)]
    out = _quiet(_head_by_size, empty)
    assert isinstance(out, raggedfn.Ragged) and out.batch_size == 0
    assert out.layout == full.layout and out.values.shape == (0, 2)
    assert_restacked(_quiet(_head_by_size, full), [_head_by_size(s) for s in raggedfn.unbind(full)])


def test_19_strict_runs_empty_samples_per_sample_without_a_warning():
    x = raggedfn.from_list(_samples([0, 3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = raggedfn.map(_attention_then_branch_on_emptiness, x, strict=True)
    assert_restacked(got, [_attention_then_branch_on_emptiness(s) for s in _samples([0, 3])])


# ----- issue 12.1: stale traces -----------------------------------------------------------


def _dropout_layer():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).double()


def test_12_1_eval_after_train_through_functional_call():
    layer = _dropout_layer()
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def f(t, p):
        return torch.func.functional_call(layer, p, (t,))

    samples = _samples([3, 4])
    x = raggedfn.from_list(samples)
    _quiet(f, x, params, in_dims=(0, None))  # training mode: dropout
    layer.eval()
    got = _quiet(f, x, params, in_dims=(0, None))
    assert_restacked(got, [f(s, params) for s in samples])


def test_12_1_eval_after_train_through_a_closure():
    layer = _dropout_layer()
    samples = _samples([3, 4])
    x = raggedfn.from_list(samples)

    def f(t):
        return layer(t)

    _quiet(f, x)
    layer.eval()
    assert_restacked(_quiet(f, x), [layer(s) for s in samples])


class _Tempered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, t):
        return (t / self.temperature).softmax(0)


def test_12_1_changed_float_attribute_of_a_module():
    module = _Tempered()
    samples = _samples([3, 4])
    x = raggedfn.from_list(samples)
    _quiet(module, x)
    module.temperature = 4.0
    assert_restacked(_quiet(module, x), [module(s) for s in samples])


SCALE = 1.0


def _scaled(t):
    return t * SCALE


def test_12_1_rebound_global_number():
    global SCALE
    samples = _samples([3, 4])
    x = raggedfn.from_list(samples)
    _quiet(_scaled, x)
    try:
        SCALE = 3.0
        assert_restacked(_quiet(_scaled, x), [_scaled(s) for s in samples])
    finally:
        SCALE = 1.0


def test_12_1_changed_attribute_of_a_captured_object():
    config = types.SimpleNamespace(scale=1.0)
    samples = _samples([3, 4])
    x = raggedfn.from_list(samples)

    def f(t):
        return t * config.scale

    _quiet(f, x)
    config.scale = 3.0
    assert_restacked(_quiet(f, x), [s * 3.0 for s in samples])


# ----- issue 12.2: empty samples and static slices ----------------------------------------


@pytest.mark.parametrize(
    ("f", "lengths"),
    [
        pytest.param(lambda t: t[:1], [2, 0, 3], id="head"),
        pytest.param(lambda t: t[0:1], [2, 0, 3], id="zero-to-one"),
        pytest.param(lambda t: t[-1:], [2, 0, 3], id="tail"),
        pytest.param(lambda t: t[:1].sum(0), [2, 0, 3], id="head-sum"),
        pytest.param(lambda t: t[-1:].mean(0), [2, 0, 3], id="tail-mean"),
        pytest.param(lambda t: t[:1], [2, 3, 0], id="head-empty-last"),
    ],
)
def test_12_2_static_slices_of_empty_samples(f, lengths):
    _same_as_loop(f, lengths)


@pytest.mark.parametrize(
    ("f", "error"),
    [
        pytest.param(lambda t: t.narrow(0, 0, 1), RuntimeError, id="narrow"),
        pytest.param(lambda t: t[0], IndexError, id="select"),
    ],
)
def test_12_2_out_of_range_on_an_empty_sample_names_the_sample(f, error):
    x = raggedfn.from_list(_samples([2, 0, 3]))
    with pytest.raises(error) as raised:  # torch's own error, as the loop raises it
        _quiet(f, x)
    assert raised.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]


# ----- issue 12.3: in-place writes --------------------------------------------------------


def _adds_in_place(t):
    t.add_(1)
    return t.sum(0)


def test_12_3_in_place_write_to_the_input_leaves_the_caller_unchanged():
    samples = _samples([2, 3, 1])
    x = raggedfn.from_list(samples)
    before, version = x.values.clone(), x.values._version
    got = _quiet(_adds_in_place, x)
    assert x.values._version == version
    torch.testing.assert_close(x.values, before, rtol=0, atol=0)
    assert_restacked(got, [_adds_in_place(s.clone()) for s in samples])


def _counts(t, buf):
    buf.add_(1)
    return t.sum(0) + buf


def test_12_3_in_place_write_to_a_shared_argument_runs_once_per_sample_or_raises():
    samples = _samples([2, 3, 1])
    x = raggedfn.from_list(samples)
    buf_loop, buf_map = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    want = [_counts(s, buf_loop) for s in samples]
    try:
        got = _quiet(_counts, x, buf_map, in_dims=(0, None))
    except RaggedError:
        return
    assert_restacked(got, want)
    assert buf_map.tolist() == buf_loop.tolist() == [3.0, 3.0]


# ----- issue 12.4: randomness ---------------------------------------------------------------


def _identical_samples(count=4, rows=2, dim=3):
    one = torch.randn(rows, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return raggedfn.from_list([one.clone() for _ in range(count)])


def test_12_4_random_draws_are_per_sample():
    x = _identical_samples()
    noise = _quiet(lambda t: t + torch.rand(3, dtype=t.dtype), x).values - x.values
    per_sample = noise.reshape(4, 2, 3)[:, 0]
    assert len({tuple(row.tolist()) for row in per_sample}) == 4


def test_12_4_randomness_same_and_error():
    x = _identical_samples()
    noise = _quiet(lambda t: t + torch.rand(3, dtype=t.dtype), x, randomness="same")
    rows = (noise.values - x.values).reshape(4, 2, 3)[:, 0]
    assert len({tuple(row.tolist()) for row in rows}) == 1
    with pytest.raises(RaggedError, match="random"):
        _quiet(lambda t: t + torch.rand(3, dtype=t.dtype), x, randomness="error")


# ----- issue 12.5: data-dependent sizes -----------------------------------------------------


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(lambda t: t[t[:, 0] > 0], id="mask"),
        pytest.param(lambda t: torch.nonzero(t[:, 0] > 0), id="nonzero"),
        pytest.param(lambda t: torch.masked_select(t, t > 0), id="masked_select"),
        pytest.param(lambda t: torch.unique((t > 0).sum(-1)), id="unique"),
    ],
)
def test_12_5_data_dependent_sizes_become_a_ragged_axis(f):
    _same_as_loop(f, [3, 0, 4, 5])


def test_12_5_boolean_mask_runs_batched_under_strict():
    _same_as_loop(lambda t: t[t[:, 0] > 0].sum(0), [3, 0, 4, 5], strict=True)


# ----- issue 12.6: output types -------------------------------------------------------------


def _untraceable(t):
    return t * 2 if t.sum() > 0 else t


def test_12_6_output_kind_does_not_depend_on_equal_lengths():
    unequal = _same_as_loop(_untraceable, [2, 3])
    equal = _same_as_loop(_untraceable, [2, 2])
    assert isinstance(unequal, raggedfn.Ragged)
    assert isinstance(equal, raggedfn.Ragged)


def test_12_6_python_numbers_restack_alike_traced_and_untraced():
    traced = _same_as_loop(lambda t: (t.sum(0), 3), [2, 3])[1]
    untraced = _same_as_loop(lambda t: (t.sum(0) if t.sum() > 0 else -t.sum(0), 3), [2, 3])[1]
    assert isinstance(traced, torch.Tensor) and isinstance(untraced, torch.Tensor)
    assert traced.dtype == untraced.dtype == torch.int64
    assert traced.tolist() == untraced.tolist() == [3, 3]


# ----- issue 12.7: map inside f -------------------------------------------------------------


def _double_rows(r):
    return r * 2 + 1


def _map_over_rows(t):
    return raggedfn.map(_double_rows, t)


def _map_over_a_ragged_value(t):
    return raggedfn.map(lambda u: u.sum(0), raggedfn.from_list([t, t[:1]]))


@pytest.mark.parametrize(
    "f",
    [
        pytest.param(_map_over_rows, id="rows"),
        pytest.param(_map_over_a_ragged_value, id="ragged"),
    ],
)
def test_12_7_map_inside_f_equals_the_loop_or_raises(f):
    samples = _samples([2, 1, 3])
    x = raggedfn.from_list(samples)
    try:
        got = _quiet(f, x)
    except RaggedError:
        return
    if isinstance(got, raggedfn.Ragged):
        raggedfn.check(got)
    assert_restacked(got, [f(s) for s in samples])


def _triple_rows(r):
    return r * 3 - 1


def test_12_7_a_nested_trace_leaves_no_cached_failure_behind():
    """Tracing the outer f runs the inner map on fake tensors; a failure there must not
    be cached for the inner function's later eager calls (an empty batch needs a trace)."""
    x = raggedfn.from_list(_samples([2, 1, 3]))
    with contextlib.suppress(RaggedError):  # nested map: the loop's answer or a refusal
        _quiet(lambda t: raggedfn.map(_triple_rows, t), x)
    empty = torch.zeros(0, 2, dtype=torch.float64)
    assert _quiet(_triple_rows, empty).shape == (0, 2)


# ----- issue 12.8: threads ------------------------------------------------------------------

_THREADS = textwrap.dedent(
    """
    import threading, torch, raggedfn

    def sample_fn(k):
        return lambda t: torch.tanh(t * (k + 1)).cumsum(0)[: k + 1].sum(0) + k

    lengths = [3, 1, 4, 2]
    samples = [torch.randn(n, 2, dtype=torch.float64) for n in lengths]
    x = raggedfn.from_list(samples)
    fns = [sample_fn(k) for k in range(4)]
    results, errors = [None] * 4, []

    def run(k):
        try:
            results[k] = raggedfn.map(fns[k], x)
        except Exception as error:
            errors.append(repr(error))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(4):
        want = torch.stack([fns[k](s) for s in samples])
        torch.testing.assert_close(results[k], want)
        torch.testing.assert_close(raggedfn.map(fns[k], x), want)
    compiled = torch.compile(lambda a: a.sin() + 1, fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.ones(3).sin() + 1)
    print("ok")
    """
)


def test_12_8_four_threads_on_a_cold_cache_then_compile():
    done = subprocess.run(
        [sys.executable, "-c", _THREADS], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ----- issue 12.9: compile --------------------------------------------------------------------


def _batch(i):
    lengths = [3 + i, 2 + (i * 5) % 7, 4 + (i * 3) % 5][: 2 + i % 2]
    x = raggedfn.from_list(_samples(lengths, seed=i))
    return x.values, x.offsets, x.sizes


W = torch.randn(2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _loss_with_a_fresh_lambda(values, offsets, sizes):
    x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
    return raggedfn.map(lambda t: torch.tanh(t @ W).sum(0), x).pow(2).sum()


def _compiled_equals_eager(fn, warm_up):
    if warm_up:
        fn(*_batch(0))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for i in range(4):
        torch.testing.assert_close(compiled(*_batch(i)), fn(*_batch(i)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_12_9_lambda_recreated_in_the_loss_compiles_after_warm_up():
    _compiled_equals_eager(_loss_with_a_fresh_lambda, warm_up=True)


def _loss_of_a_new_function(values, offsets, sizes):
    x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
    return raggedfn.map(lambda t: (t @ W).softmax(0).sum(0) * 3, x).pow(2).sum()


def test_12_9_compile_without_an_eager_warm_up():
    _compiled_equals_eager(_loss_of_a_new_function, warm_up=False)


def _loss_with_a_fallback_node(values, offsets, sizes):
    x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
    return raggedfn.map(lambda t: t.flip(0).cumsum(0), x).values.pow(2).sum()


def test_12_9_fallback_node_under_fullgraph_runs_or_names_the_op():
    try:
        with warnings.catch_warnings(record=True):  # the fallback's performance warning
            warnings.simplefilter("always")
            _compiled_equals_eager(_loss_with_a_fallback_node, warm_up=True)
    except Exception as error:
        chain = [error]
        while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        # dynamo re-raises a RaggedError from compiled code as its own Unsupported
        # ("Observed exception") that carries the RaggedError's text
        assert any("RaggedError" in repr(e) + str(e) and "flip" in str(e) for e in chain), error


def test_12_9_a_fallback_warns_with_a_performance_warning():
    x = raggedfn.from_list(_samples([2, 3]))
    category = raggedfn.RaggedPerformanceWarning
    assert issubclass(category, UserWarning)
    with pytest.warns(category, match="flip"):
        raggedfn.map(lambda t: t.flip(0) * 1.5, x)


def _second_selected_row(t):
    return t[t[:, 0] > 0].narrow(0, 1, 1)


def _loss_of_a_checked_data_dependent_size(values, offsets, sizes):
    x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
    return raggedfn.map(_second_selected_row, x).pow(2).sum()


def test_19_a_check_on_a_data_dependent_size_compiles_as_an_assertion():
    """Under compile the check on the mask's count is a device assertion (no host sync,
    no loop inside the graph); a batch that breaks it stops, as for any guard there."""
    rows = torch.tensor([[1.0, 0.0], [2.0, 0.5], [-1.0, 3.0]], dtype=torch.float64)
    good = raggedfn.from_list([rows, rows.flip(0)])
    bad = raggedfn.from_list([rows, -rows])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_loss_of_a_checked_data_dependent_size, fullgraph=True, dynamic=True)
    args = (good.values, good.offsets, good.sizes)
    torch.testing.assert_close(compiled(*args), _loss_of_a_checked_data_dependent_size(*args))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    with pytest.raises(RuntimeError, match=r"raggedfn\.map: guard"):
        compiled(bad.values, bad.offsets, bad.sizes)


MHA = torch.nn.MultiheadAttention(2, 1, batch_first=True, dtype=torch.float64).eval()


def _loss_of_attention_with_empty_samples(values, offsets, sizes):
    x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
    out = raggedfn.map(lambda t: MHA(t[None], t[None], t[None], need_weights=False)[0][0], x)
    return out.values.pow(2).sum()


def test_19_torch_guards_against_empty_samples_hold_them_under_compile():
    """nn.MultiheadAttention's SDPA call records ``Ne(n, 0)`` (a kernel choice in C++).
    Eagerly an empty sample runs per sample; under compile no sample can, and the
    batched rules (which follow torch for empty samples) run it instead of stopping."""
    batch = raggedfn.from_list(_samples([3, 0, 2]))
    eager = raggedfn.map_report(
        lambda t: MHA(t[None], t[None], t[None], need_weights=False)[0][0], batch
    )
    assert any("Ne(" in g and ", 0)" in g for g in eager.guards), eager.guards
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_loss_of_attention_with_empty_samples, fullgraph=True, dynamic=True)
    for lengths in ([3, 0, 2], [4, 2, 0]):
        x = raggedfn.from_list(_samples(lengths))
        args = (x.values, x.offsets, x.sizes)
        got = compiled(*args)
        with warnings.catch_warnings():  # eagerly the empty sample's own plan may fall back
            warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
            want = _loss_of_attention_with_empty_samples(*args)
        torch.testing.assert_close(got, want)
    # as _compiled_equals_eager: the first call's graph and at most one more (the
    # trace made while compiling); new lengths never add one
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_19_a_part_of_no_samples_does_not_make_a_merged_axis_ragged():
    """merge: sizes come from the parts that have samples (an empty part has none)."""
    from raggedfn._map.running._split import merge

    same = raggedfn.from_list([torch.ones(2, 3), torch.zeros(2, 3)])
    none = same[torch.zeros(0, dtype=torch.int64)]
    out = merge([(torch.tensor([1, 0]), same), (torch.zeros(0, dtype=torch.int64), none)], 2)
    assert isinstance(out, torch.Tensor)  # every sample [2, 3]: dense, as without the part
    assert torch.equal(out, torch.stack([torch.zeros(2, 3), torch.ones(2, 3)]))


def _numel_branch_after_a_slice(t):
    h = t[:-3]
    return h, (h.sum() + 1 if h.numel() > 0 else h.sum() - 1)


@pytest.mark.parametrize("shapes", [[(0, 0), (0, 1), (0, 1)], [(4, 0), (5, 1), (2, 3), (1, 2)]])
def test_19_a_size_that_a_guard_refines_to_one_value_is_guarded(shapes):
    """Program 3127 of the oracle's seed 7: the guard ``2*s1*Max(0, s0 - 3) <= 0`` made
    torch's ShapeEnv refine s1 (the second ragged axis) to the single value 0 without a
    guard of its own, so every sample of the plan's group came back with 0 columns."""
    gen = torch.Generator().manual_seed(1)
    x = raggedfn.from_list(
        [torch.randn(*s, 2, generator=gen, dtype=torch.float64) for s in shapes],
        ragged_dims=(1, 2),
    )
    got = _quiet(_numel_branch_after_a_slice, x)
    assert_restacked(got, [_numel_branch_after_a_slice(s) for s in raggedfn.unbind(x)])


def _scaled_by_a_float_read_from_the_data(t):
    return t * t.sum().item()


def test_19_a_float_read_with_item_is_defined_per_sample():
    """``.item()`` of a float tensor is an unbacked float (``zuf0``) in the trace: it was
    never given its per-sample values (``KeyError: 'zuf0'`` where the loop runs)."""
    x = raggedfn.from_list(_samples([3, 0, 2]))
    got = _quiet(_scaled_by_a_float_read_from_the_data, x)
    want = [_scaled_by_a_float_read_from_the_data(s) for s in raggedfn.unbind(x)]
    assert_restacked(got, want)
    x32 = raggedfn.from_list([s.float() for s in _samples([2, 4])])
    got = _quiet(_scaled_by_a_float_read_from_the_data, x32)
    assert got.dtype == torch.float32  # a Python number does not promote the tensor
    assert_restacked(got, [_scaled_by_a_float_read_from_the_data(s) for s in raggedfn.unbind(x32)])


def _gated_by_a_bool_read_from_the_data(t):
    return t * (t.sum() > 0).item()


def test_a_bool_read_with_item_is_defined_per_sample():
    """``.item()`` of a bool tensor is torch's ``Eq(u0, 1)`` in the trace: ``u0`` was
    never given its per-sample values (``KeyError: 'u0'`` where the loop runs; found by
    the mutation helper). Empty samples (a False gate) included, float32 not promoted."""
    x = raggedfn.from_list(_samples([3, 0, 2, 4]))
    report = raggedfn.map_report(_gated_by_a_bool_read_from_the_data, x)
    assert report.whole_loop is None and "aten.mul.Tensor" in report.batched, report
    got = _quiet(_gated_by_a_bool_read_from_the_data, x)
    want = [_gated_by_a_bool_read_from_the_data(s) for s in raggedfn.unbind(x)]
    assert_restacked(got, want)
    assert any(bool((s.sum() > 0).item()) for s in raggedfn.unbind(x))
    assert any(not bool((s.sum() > 0).item()) for s in raggedfn.unbind(x))
    x32 = raggedfn.from_list([s.float() for s in _samples([2, 4])])
    got = _quiet(_gated_by_a_bool_read_from_the_data, x32)
    assert got.dtype == torch.float32
    assert_restacked(got, [_gated_by_a_bool_read_from_the_data(s) for s in raggedfn.unbind(x32)])


def _select_from_zeros_when_empty(t):
    # program 1347 of seed 11: under the n == 0 plan masked_select runs once, on a
    # tensor no sample owns; its data-dependent size is the same for every sample
    h = t.new_zeros(2) if t.shape[0] == 0 else t.amax(0)
    return h, torch.masked_select(h, h > 0)


@pytest.mark.parametrize("lengths", [[0], [0, 0], [0, 7, 3], [4, 0]])
def test_a_data_dependent_size_of_an_op_on_shared_values_is_defined(lengths):
    """It raised "op aten.masked_select.default made a data-dependent size its rule did
    not define" on every batch holding an empty sample."""
    _same_as_loop(_select_from_zeros_when_empty, lengths)


@pytest.mark.parametrize(
    ("f", "batched"),
    [
        pytest.param(lambda t: torch.add(torch.tanh(t), t, alpha=t.shape[0]), False, id="alpha"),
        pytest.param(lambda t: torch.add(t, t.sum(0), alpha=t.shape[0]), False, id="alpha-dense"),
        pytest.param(lambda t: torch.sub(t, t.exp(), alpha=t.shape[0]), False, id="sub-alpha"),
        pytest.param(lambda t: torch.add(t, t, alpha=t.sum().item()), False, id="alpha-item"),
        pytest.param(lambda t: torch.addcmul(t, t, t, value=t.shape[0]), False, id="addcmul"),
        # a float read from the data, in the node's loop: it was truncated to an int
        pytest.param(lambda t: F.leaky_relu(t, t.abs().sum().item() / 7), False, id="slope"),
        pytest.param(lambda t: F.elu(t, alpha=t.abs().sum().item()), False, id="elu-alpha"),
        pytest.param(lambda t: torch.clamp(t, min=-t.shape[0] / 4), True, id="clamp-min"),
        pytest.param(lambda t: torch.clamp(t, -t.shape[0] / 4, t.shape[0] / 4), True, id="clamp"),
        pytest.param(lambda t: t.clamp_max(t.shape[0] / 4), True, id="clamp-max"),
    ],
)
def test_a_per_sample_number_in_a_scalar_argument_equals_the_loop(f, batched):
    """A per-sample size or item where the op's schema takes a Scalar: aten refused the
    batched tensor ("Expected a value of type 'number' for argument 'alpha'"); clamp's
    bounds take its Tensor overload (batched), the rest run the node's loop."""
    samples = _samples([3, 1, 0, 4])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        report = raggedfn.map_report(f, raggedfn.from_list(samples))
    assert_restacked(report.output, [f(s.clone()) for s in samples])
    assert report.fully_batched == batched, str(report)


def _bounded_by_the_length(t):
    return torch.clamp(t, min=-t.shape[0] / 4, max=t.shape[0] / 4) * 2


def _loss_of_bounds_by_the_length(values, offsets, sizes):
    x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
    return raggedfn.map(_bounded_by_the_length, x).values.pow(2).sum()


def test_a_per_sample_bound_compiles_to_clamps_tensor_overload():
    """Inside torch.compile the op's Scalar slots are read outside dynamo's view
    (``_registry.scalar_slots``; dynamo cannot iterate a pybind schema)."""
    x = raggedfn.from_list(_samples([3, 1, 5]) * 2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_loss_of_bounds_by_the_length, fullgraph=True, dynamic=True)
    args = (x.values, x.offsets, x.sizes)
    expected = sum(_bounded_by_the_length(s).pow(2).sum() for s in raggedfn.unbind(x))
    torch.testing.assert_close(compiled(*args), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
