"""Batching rules for the ops of transformers' packed-sequence check (5.25's
``find_packed_sequence_indices`` and the mask built from it): ``torch.diff`` along
ragged and dense axes, integer tensor indexing with per-sample positions, and
``new_ones`` of a fixed shape. Each is compared with the per-sample loop on random
lengths (0 and 1 included), in values and float64 gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import assert_same, loop
from tests.test_map import D, pairs, tokens, weights

SHARED = weights(2, D, seed=30)
LENGTHS = st.lists(st.integers(0, 6), min_size=1, max_size=4)


def _hf_segments(t, consecutive=False):
    """transformers 5.25's packed-sequence ids of one sample's positions (with repeats,
    i.e. restarts, from the data; or 0, 1, 2, ...)."""
    pos = torch.arange(t.shape[0]) if consecutive else (t[:, 0] > 0).long().cumsum(0)
    pos = pos[None]
    return (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)


def _hf_mask(t, consecutive=False):
    """transformers 5.25's sdpa mask of one sample: same segment, read by index."""
    seg = _hf_segments(t, consecutive)
    b = torch.arange(1)[:, None, None, None]
    q = torch.arange(t.shape[0])[None, None, :, None]
    kv = torch.arange(t.shape[0])[None, None, None, :]
    return t.new_ones((), dtype=torch.bool) & (seg[b, q] == seg[b, kv])


DIFFS = [
    lambda t: torch.diff(t, dim=0),  # along the ragged axis
    lambda t: torch.diff(t, n=2, dim=0),
    lambda t: torch.diff(t, n=3, dim=0).sum(0),
    lambda t: torch.diff(t, dim=0, prepend=t[:1] - 1),  # transformers' call
    lambda t: torch.diff(t, dim=0, append=SHARED),  # a shared append
    lambda t: torch.diff(t, n=2, dim=0, prepend=t[-2:], append=t[:1] * 2),
    lambda t: torch.diff(t.T, dim=1, prepend=SHARED.T),  # ragged axis stored first, last logically
    lambda t: torch.diff(t, dim=1),  # along a dense axis
    lambda t: torch.diff(t, dim=-1, prepend=t[:, :2], append=t[:, 1:3]),
    lambda t: torch.diff(t > 0, dim=0),  # bool: xor
    lambda t: torch.diff((t * 3).long(), n=2, dim=0),
    _hf_segments,
]


@settings(max_examples=12, deadline=None)
@given(lengths=LENGTHS, which=st.integers(0, len(DIFFS) - 1))
def test_diff_equals_the_loop(lengths, which):
    f = DIFFS[which]
    x = tokens(lengths)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert not report.fallback, str(report)


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("lengths", [(3, 0, 1, 4), (2, 5, 1)])
def test_diff_of_a_pair_state_equals_the_loop(dim, lengths):
    x = pairs(lengths)
    if 0 in lengths:
        f = lambda p: torch.diff(p, dim=dim)  # noqa: E731
    else:
        f = lambda p: torch.diff(p, dim=dim, prepend=p.narrow(dim, 0, 1) * 0.5)  # noqa: E731
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    # a pair state's empty samples get a plan of their own whose sizes are fixed by a
    # guard; there diff runs per sample (nothing to compute)
    assert set(report.fallback) <= ({"aten.diff.default"} if 0 in lengths else set()), str(report)
    assert report.batched.get("aten.diff.default"), str(report)


def _loss(out):
    values = out.values if isinstance(out, raggedfn.Ragged) else out
    return values.pow(2).sum() + values.sum()


@pytest.mark.parametrize("which", [0, 1, 2, 3, 4, 5, 6, 7, 8])
def test_diff_gradients_equal_the_loop(which):
    f = DIFFS[which]
    x = tokens((4, 0, 1, 2, 5))
    values = x.values.clone().requires_grad_()
    xv = x.with_values(values)
    got = torch.autograd.grad(_loss(raggedfn.map(f, xv)), values)[0]
    want = torch.autograd.grad(sum(_loss(o) for o in loop(f, xv)), values)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "f",
    [
        # the ragged axis at position 1 of the sample, sides of a fixed size per sample
        pytest.param(
            lambda t: torch.diff(t.T, dim=1, prepend=t.sum(0, keepdim=True).T), id="prepend"
        ),
        pytest.param(
            lambda t: torch.diff(t.T, n=2, dim=-1, append=t.mean(0, keepdim=True).T * 2),
            id="append",
        ),
    ],
)
def test_diff_with_a_per_sample_fixed_side_on_a_later_ragged_axis_equals_the_loop(f):
    x = tokens((4, 1, 0, 3, 2))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert not report.fallback, str(report)
    values = x.values.clone().requires_grad_()
    xv = x.with_values(values)
    got = torch.autograd.grad(_loss(raggedfn.map(f, xv)), values)[0]
    want = torch.autograd.grad(sum(_loss(o) for o in loop(f, xv)), values)[0]
    torch.testing.assert_close(got, want)


def test_diff_along_a_dense_axis_with_a_shared_prepend_under_fixed_rows_runs_batched():
    # rows fixed by a Python branch (Eq(s, 3)) let a shared [3, 1] prepend fit; the plan
    # of that branch fixes the rows, so its samples run stacked as [B, 3, C] tensors and
    # diff with the shared prepend is an op on fixed-shape samples (no per-sample loop)
    shared = weights(3, 1, seed=5)

    def f(t):
        if t.shape[0] == 3:
            return torch.diff(t, dim=1, prepend=shared)
        return torch.diff(t, dim=1, prepend=t[:, :1])

    x = tokens((3, 2, 3))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_diff_gradcheck_along_the_ragged_axis():
    x = tokens((3, 1, 0, 4), dim=2)
    f = lambda t: torch.diff(t, n=2, dim=0, prepend=t[:1] - 1)  # noqa: E731

    def g(values):
        return raggedfn.map(f, x.with_values(values)).values

    values = x.values.clone().requires_grad_()
    assert torch.autograd.gradcheck(g, (values,))
    assert torch.autograd.gradgradcheck(g, (values,))


INDEXES = [
    lambda t: t[t.shape[0] - 1 - torch.arange(t.shape[0])],  # reversed rows
    lambda t: t[-1 - torch.arange(t.shape[0])],  # negative positions
    lambda t: t[torch.arange(t.shape[0]), torch.arange(t.shape[0]) % D],  # ragged and dense
    lambda t: t[torch.arange(t.shape[0])[:, None] % 2, torch.tensor([[1, 0, 3]])],
    lambda t: t[:, 0][None][torch.zeros(1, 1, dtype=torch.long), torch.arange(t.shape[0])[None]],
    _hf_mask,
    lambda t: t.new_ones((3,)) * t[:, :3],  # a fixed-shape factory: shared
    lambda t: t.new_full((2, 1), 0.5) + t.sum(0),
]


@settings(max_examples=12, deadline=None)
@given(lengths=LENGTHS, which=st.integers(0, len(INDEXES) - 1))
def test_integer_index_and_fixed_factories_equal_the_loop(lengths, which):
    f = INDEXES[which]
    x = tokens(lengths)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert not report.fallback, str(report)


def test_a_shared_index_into_the_ragged_axis_gives_a_fixed_shape():
    f = lambda t: t[torch.tensor([0, -1, 1])]  # noqa: E731
    x = tokens((2, 5, 3))
    report = raggedfn.map_report(f, x)
    assert isinstance(report.output, torch.Tensor) and report.output.shape == (3, 3, D)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_an_index_past_a_sample_end_raises_naming_the_sample():
    with pytest.raises(IndexError, match="index 2 is out of bounds") as error:
        raggedfn.map(lambda t: t[torch.tensor([0, 2])], tokens((3, 2, 4)))
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]


def test_an_index_before_a_ragged_axis_runs_per_sample_and_says_why():
    # per-sample positions into the first axis of a pair state: its second, ragged axis
    # comes after the indexed one; no rule for that, the loop runs it and the report
    # names the reason
    p = pairs((3, 2, 4))
    f = lambda q: q[(q[:, 0, 0] > 0).long()]  # noqa: E731
    report = raggedfn.map_report(f, p)
    assert_same(report.output, loop(f, p))
    assert report.fallback == {"aten.index.Tensor": "a ragged axis after the indexed axes"}, str(
        report
    )


def test_index_gradients_equal_the_loop():
    x = tokens((4, 0, 1, 3))
    values = x.values.clone().requires_grad_()
    xv = x.with_values(values)
    f = INDEXES[3]
    got = torch.autograd.grad(_loss(raggedfn.map(f, xv)), values)[0]
    want = torch.autograd.grad(sum(_loss(o) for o in loop(f, xv)), values)[0]
    torch.testing.assert_close(got, want)


def test_a_write_into_a_fixed_shape_factory_stays_per_sample():
    def f(t):
        z = t.new_zeros(D)
        z.add_(t.sum(0))
        return z

    x = tokens((3, 0, 2))
    assert_same(raggedfn.map(f, x), loop(f, x))


def _attention(consecutive):
    def f(t):
        q = t.reshape(t.shape[0], 2, D // 2).transpose(0, 1)[None]  # [1, H, N, Dh]
        return F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=_hf_mask(t, consecutive))[0]

    return f


@pytest.mark.parametrize("consecutive", [True, False])
def test_attention_with_transformers_packed_mask_equals_the_loop(monkeypatch, consecutive):
    # consecutive positions: the mask is True everywhere (transformers' eager code drops
    # it) and map runs the length-bucketed kernels; positions that restart inside a
    # sample: the (query, key) pair formulation with the mask
    from raggedfn._map.rules import _attention as attention_rules

    calls = []
    real = attention_rules._via_attention
    monkeypatch.setattr(attention_rules, "_via_attention", lambda *a: calls.append(1) or real(*a))
    f = _attention(consecutive)
    x = tokens((4, 1, 0, 6, 3), seed=3)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert not report.fallback, str(report)
    assert bool(calls) == consecutive
    values = x.values.clone().requires_grad_()
    xv = x.with_values(values)
    got = torch.autograd.grad(_loss(raggedfn.map(f, xv)), values)[0]
    want = torch.autograd.grad(sum(_loss(o) for o in loop(f, xv)), values)[0]
    torch.testing.assert_close(got, want)
    grad = torch.func.grad(lambda v: _loss(raggedfn.map(f, x.with_values(v))))(x.values)
    torch.testing.assert_close(grad, want)


def _two_layers(t, mask):
    """Two attention layers given one boolean mask, as every layer of a BERT gets one."""
    q = t.reshape(t.shape[0], 2, D // 2).transpose(0, 1)[None]  # [1, H, N, Dh]
    h = F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=mask)
    return F.scaled_dot_product_attention(h, h * 0.5, h, attn_mask=mask)[0]


def _count_mask_reads(monkeypatch):
    """The host reads of whether a mask is True everywhere (``_index.host_all``)."""
    from raggedfn import _index

    reads = []
    real = _index._read_all
    monkeypatch.setattr(_index, "_read_all", lambda t: reads.append(t.shape) or real(t))
    return reads


@pytest.mark.parametrize("consecutive", [True, False])
def test_layers_given_one_mask_read_it_once(monkeypatch, consecutive):
    # eagerly, the attention rule asks whether the mask is True everywhere (a host read,
    # a device sync on a GPU); the answer is remembered with the mask tensor, so the
    # second layer does not read it again. consecutive: True everywhere (dropped)
    reads = _count_mask_reads(monkeypatch)
    f = lambda t: _two_layers(t, _hf_mask(t, consecutive))  # noqa: E731  (mask built once)
    x = tokens((4, 1, 0, 6, 3), seed=3)
    want = loop(f, x)
    report = raggedfn.map_report(f, x)  # traces f, then the general path
    assert_same(report.output, want)
    assert not report.fallback, str(report)
    assert len(reads) == 1
    for _ in range(2):  # the warm call: a new mask each call, read once
        reads.clear()
        assert_same(raggedfn.map(f, x), want)
        assert len(reads) == 1


def test_a_mask_changed_in_place_between_calls_is_read_again(monkeypatch):
    reads = _count_mask_reads(monkeypatch)
    lengths = (4, 2, 5, 3)  # (0 and 1 would run apart, on slices of the caller's mask)
    x = tokens(lengths, seed=5)
    mask = raggedfn.from_list(
        [torch.ones(n, n, dtype=torch.bool) for n in lengths], ragged_dims=(1, 2)
    )
    for _ in range(2):  # the caller's mask: read at the first call only
        reads.clear()
        assert_same(raggedfn.map(_two_layers, x, mask), loop(_two_layers, x, mask))
    assert not reads
    mask.values[1] = False  # sample 0: query 0 no longer sees key 1
    assert_same(raggedfn.map(_two_layers, x, mask), loop(_two_layers, x, mask))
    assert len(reads) == 1


@pytest.mark.parametrize(
    "mask",
    [
        pytest.param(lambda t: torch.ones((1, 1), dtype=torch.bool), id="shared"),
        pytest.param(lambda t: (t.sum() == t.sum())[None, None], id="per-sample-fixed"),
    ],
)
def test_attention_with_a_true_mask_of_fixed_shape_takes_the_length_bucketed_kernels(
    monkeypatch, mask
):
    # a boolean mask True everywhere that is shared or of a fixed shape per sample masks
    # nothing either: dropped, the length-bucketed kernels run, equal to the loop
    from raggedfn._map.rules import _attention as attention_rules

    calls = []
    real = attention_rules._via_attention
    monkeypatch.setattr(attention_rules, "_via_attention", lambda *a: calls.append(1) or real(*a))

    def f(t):
        q = t.reshape(t.shape[0], 2, D // 2).transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=mask(t))[0]

    x = tokens((4, 1, 0, 6, 3), seed=6)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert not report.fallback, str(report)
    assert calls, "the mask was not dropped"


@pytest.mark.parametrize(
    "mask",
    [
        pytest.param(lambda t: (t @ t.T) * 0.1, id="float-nonzero"),  # no zero: .all() is True
        pytest.param(lambda t: (t @ t.T).clamp(min=0), id="float-zeros"),
    ],
)
def test_attention_with_a_float_mask_is_not_dropped(mask):
    # only a boolean mask that is True everywhere masks nothing; an additive float mask
    # (non-zero everywhere or not) is added to the logits, as in the loop
    def f(t):
        q = t.reshape(t.shape[0], 2, D // 2).transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=mask(t))[0]

    x = tokens((4, 1, 0, 6, 3), seed=5)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert not report.fallback, str(report)
    values = x.values.clone().requires_grad_()
    xv = x.with_values(values)
    got = torch.autograd.grad(_loss(raggedfn.map(f, xv)), values)[0]
    want = torch.autograd.grad(sum(_loss(o) for o in loop(f, xv)), values)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)
def test_compiled_attention_with_a_mask_runs_the_varlen_op_with_it():
    # under torch.compile the mask cannot be read on the host: the varlen custom op takes
    # it and reads it per sample (a sample whose mask is True everywhere runs without it)
    from torch._dynamo.utils import counters

    f = _attention(False)  # positions that restart: masks that are not all True
    layout = tokens((2,)).layout

    def forward(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, layout)
        return raggedfn.map(f, x).values

    targets: set[str] = set()

    def backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        targets.update(str(node.target) for node in gm.graph.nodes)
        return aot_eager(gm, example_inputs)

    forward(*_fields(tokens((5, 3), seed=4)))  # the eager trace of f
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend=backend)
    for seed, lengths in enumerate([(6, 2, 4), (3, 7), (5, 5, 2, 3)]):
        x = tokens(lengths, seed=seed)
        values = x.values.clone().requires_grad_()
        got = compiled(values, x.offsets, x.sizes)
        want = loop(f, x.with_values(values))
        torch.testing.assert_close(got, torch.cat([o.transpose(0, 1) for o in want]))  # [T, H, Dh]
        grad = torch.autograd.grad(_loss(got), values)[0]
        expected = torch.autograd.grad(sum(_loss(o) for o in want), values)[0]
        torch.testing.assert_close(grad, expected)
    assert counters["stats"]["unique_graphs"] == 1
    assert any("varlen_attention" in t for t in targets), sorted(targets)


def test_attention_with_a_mask_in_the_dynamo_branch_run_eagerly_takes_the_varlen_op(monkeypatch):
    # the compiled test above cannot run under mutmut (dynamo does not trace its
    # trampolines): map's branch under torch.compile, run eagerly with is_compiling()
    # patched to True, takes the varlen custom op with the mask (_via_varlen_mask) too
    from raggedfn import _prims

    calls = []
    real = _prims.varlen_attention
    monkeypatch.setattr(_prims, "varlen_attention", lambda *a: calls.append(a[-1]) or real(*a))
    f = _attention(False)  # positions that restart: masks that are not all True
    raggedfn.map(f, tokens((5, 3), seed=4))  # the eager trace of f
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for seed, lengths in enumerate([(6, 2, 4), (3, 7), (5, 5, 2, 3)]):
        calls.clear()
        x = tokens(lengths, seed=seed)
        values = x.values.clone().requires_grad_()
        got = raggedfn.map(f, x.with_values(values))
        want = loop(f, x.with_values(values))
        assert_same(got, want)
        assert len(calls) == 1 and calls[0].dtype == torch.bool, calls
        grad = torch.autograd.grad(_loss(got), values)[0]
        expected = torch.autograd.grad(sum(_loss(o) for o in want), values)[0]
        torch.testing.assert_close(grad, expected)


def test_attention_of_three_axes_with_a_mask_in_the_dynamo_branch_takes_the_varlen_op(
    monkeypatch,
):
    # as above with q [H, N, Dh] (no leading axis: the packed values are [N, H, Dh]) and a
    # [1, N, N] mask: the varlen op gets every head (H = 2 per packed row)
    from raggedfn import _prims

    calls = []
    real = _prims.varlen_attention
    monkeypatch.setattr(_prims, "varlen_attention", lambda *a: calls.append(a[0].shape) or real(*a))

    def f(t):
        q = t.reshape(t.shape[0], 2, D // 2).transpose(0, 1)  # [H, N, Dh]
        return F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=_hf_mask(t)[0])

    raggedfn.map(f, tokens((5, 3), seed=4))  # the eager trace of f
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for seed, lengths in enumerate([(6, 2, 4), (3, 7)]):
        calls.clear()
        x = tokens(lengths, seed=seed)
        got = raggedfn.map(f, x)
        assert_same(got, loop(f, x))
        assert calls == [(sum(lengths), 2, D // 2)], calls


def _fields(x):
    return x.values, x.offsets, x.sizes


@pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)
def test_compiled_attention_with_a_mask_per_head_runs_the_pair_formulation():
    # a boolean mask that differs between the heads does not fit the varlen op (one mask
    # per sample, shared by the heads): the (query, key) pair formulation runs it, as the
    # loop; the diagonal is always kept (q . q / 2 >= 0)
    from torch._dynamo.utils import counters

    def f(t):
        q = t.reshape(t.shape[0], 2, D // 2).transpose(0, 1)[None]  # [1, H, N, Dh]
        keep = (q @ (q * 0.5).transpose(-1, -2) >= 0) & _hf_mask(t)  # [1, H, N, N]
        return F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=keep)[0]

    layout = tokens((2,)).layout

    def forward(values, offsets, sizes):
        return raggedfn.map(f, raggedfn.Ragged(values, offsets, sizes, layout)).values

    targets: set[str] = set()

    def backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        targets.update(str(node.target) for node in gm.graph.nodes)
        return aot_eager(gm, example_inputs)

    forward(*_fields(tokens((5, 3), seed=4)))  # the eager trace of f
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend=backend)
    for seed, lengths in enumerate([(6, 2, 4), (3, 7)]):
        x = tokens(lengths, seed=seed)
        values = x.values.clone().requires_grad_()
        got = compiled(values, x.offsets, x.sizes)
        want = loop(f, x.with_values(values))
        torch.testing.assert_close(got, torch.cat([o.transpose(0, 1) for o in want]))
        grad = torch.autograd.grad(_loss(got), values)[0]
        expected = torch.autograd.grad(sum(_loss(o) for o in want), values)[0]
        torch.testing.assert_close(grad, expected)
    assert counters["stats"]["unique_graphs"] == 1
    assert not any("varlen_attention" in t for t in targets), sorted(targets)
