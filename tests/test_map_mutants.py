"""``raggedfn.map`` behaviour that ``make mutate`` found untested (docs/testing.md).

Each test compares ``map`` with the per-sample loop (``property_tests.reference.loop``)
and checks how the call ran (``map_report``); each was seen failing with the
surviving mutant applied.
"""

from __future__ import annotations

import functools
import sys
import typing
import warnings

import pytest
import sympy
import torch
import torch.nn.functional as F
import torch.utils._sympy.functions as symfn

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedPerformanceWarning

D = 4
LENGTHS = (3, 0, 5, 1)


def tokens(lengths=LENGTHS, dim=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, dim, generator=gen, dtype=torch.float64) for n in lengths]
    )


def weights(*shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def test_shared_matrix_times_a_ragged_one_is_batched():
    # w (shared, unbatched) @ t.T: the product enumerates (m, n) with n ragged and
    # takes every row of w for each; with leading axes on w too
    x = tokens()
    for w in (weights(6, D), weights(2, 6, D, seed=2)):

        def f(t, w):
            return w @ t.T

        report = raggedfn.map_report(f, x, w, in_dims=(0, None))
        assert_same(report.output, loop(f, x, w))
        assert report.fully_batched, str(report)


def test_type_as_of_a_dense_per_sample_result_casts_as_torch():
    # t.sum(0) is a fixed-shape per-sample tensor; type_as with the batched t casts it
    x = tokens()

    def f(t):
        return t.sum(0).to(torch.float32).type_as(t) * 2

    report = raggedfn.map_report(f, x)
    assert report.output.dtype == torch.float64
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_chains_of_in_place_ops_on_fresh_values_are_batched():
    # h.add_ then h.mul_ then relu_ on the alias each in-place op returns
    x = tokens()

    def f(t):
        h = t * 2
        h.add_(1).mul_(3)
        torch.relu_(h)
        return h.sum(-1)

    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_grouped_query_attention_with_shared_keys_loops_and_says_why():
    # keys/values shared by every sample (unbatched) with fewer heads than the query:
    # no batching rule repeats an unbatched tensor's heads; the node runs per sample
    # (as torch) and the report names the reason
    x = tokens(dim=4 * 2)
    kv = weights(2, 3, 2, seed=3)

    def f(t, kv):
        q = t.reshape(t.shape[0], 4, 2).transpose(0, 1)  # (4, N, 2)
        return F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).transpose(0, 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, x, kv, in_dims=(0, None))
    assert_same(report.output, loop(f, x, kv))
    assert report.fallback == {
        "aten.scaled_dot_product_attention.default": "grouped-query attention with these head counts"
    }, str(report)


def test_a_whole_loop_keeps_an_axis_ragged_when_it_has_the_inputs_sizes_after_a_shared_argument():
    # equal lengths: only the input's ragged size says the output axis is ragged; the
    # shared argument before the batched one must not end the search for input sizes
    x = tokens((3, 3))
    w = weights(D)

    def f(w, t):
        if t.sum() > 0:  # data-dependent: the whole call runs per sample
            return t * w
        return t - w

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, w, x, in_dims=(None, 0))
    assert report.whole_loop is not None
    assert isinstance(report.output, raggedfn.Ragged), type(report.output)
    assert_same(report.output, [f(w, t) for t in raggedfn.unbind(x)])


def _documents():
    gen = torch.Generator().manual_seed(4)
    return raggedfn.from_list(
        [[torch.randn(n, 3, generator=gen) for n in doc] for doc in ([2, 3], [], [1])]
    )


def test_a_nested_value_runs_per_sample_says_why_and_strict_refuses():
    x = _documents()

    def f(sample):
        return raggedfn.sum(sample, 1) * len(sample)  # a size of the sample: not batched

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, x)
    assert report.whole_loop == (
        "f maps over a nested value (its samples are Ragged values), not batched: "
        "f reads the sample's length (len)"
    )
    assert_same(report.output, [f(x[i]) for i in range(x.batch_size)])
    with pytest.raises(
        raggedfn.RaggedError,
        match=r"^map: f maps over a nested value \(its samples are Ragged values\), not "
        r"batched: f reads the sample's length \(len\); strict=True refuses the per-sample loop",
    ):
        raggedfn.map(f, x, strict=True)


def test_a_partial_loop_is_reported_with_its_reason():
    # t[len(t) // 2] guards on the length: samples no plan fits run per sample
    x = tokens((5, 2, 4, 3, 6, 7))

    def f(t):
        return t[len(t) // 2]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, x)
    assert isinstance(report.partial_loop, str) and report.partial_loop, str(report)
    assert f"  some samples ran per sample: {report.partial_loop}" in str(report).splitlines()
    assert_same(report.output, loop(f, x))


def _size_expressions():
    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    return [
        s0 + 2 * s1 + 1,
        s0 * s1,
        s0**2,
        symfn.PowByNatural(s0, 3),
        symfn.FloorDiv(s0, s1),
        symfn.Mod(s0, s1),
        symfn.PythonMod(s0, s1),
        symfn.IntTrueDiv(s0, s1),
        symfn.FloatTrueDiv(symfn.ToFloat(s0), symfn.ToFloat(s1)),
        symfn.CeilDiv(s0, s1),
        symfn.Max(s0, s1),
        symfn.Min(s0, s1),
        symfn.Max(s0, s1, 6),
        symfn.Min(s0, 3),
        symfn.ModularIndexing(s0, 2, 3),
        sympy.Eq(s0, s1),
        sympy.Ne(s0, s1),
        sympy.Lt(s0, s1),
        sympy.Le(s0, s1),
        sympy.Gt(s0, s1),
        sympy.Ge(s0, s1),
        sympy.And(sympy.Ge(s0, 4), sympy.Lt(s1, 4)),
        sympy.Or(sympy.Eq(s0, 2), sympy.Gt(s1, 3)),
        sympy.Not(sympy.Eq(s0, s1)),
        # sympy folds Not(Eq) to Ne: a Not of a conjunction stays a Not
        sympy.Not(sympy.And(sympy.Ge(s0, 4), sympy.Lt(s1, 4))),
        sympy.Rational(1, 2) * s0,
        symfn.ToFloat(s0),
    ]


@pytest.mark.parametrize("expr", _size_expressions(), ids=str)
def test_size_expressions_evaluate_per_sample_as_sympy(expr):
    # map evaluates traced size expressions on [B] size tensors (and on Python ints
    # when a size is static): each sample's value is sympy's own for that sample
    from raggedfn._map.base._sizes import compile_expr

    firsts, seconds = [5, 2, 7, 4, 9, 1], [3, 2, 1, 4, 9, 5]
    fn = compile_expr(expr)
    symbols = sorted(expr.free_symbols, key=str)
    batched = fn({"s0": torch.tensor(firsts), "s1": torch.tensor(seconds)})
    for i, (a, b) in enumerate(zip(firsts, seconds, strict=True)):
        values = dict(zip(symbols, (a, b)[: len(symbols)], strict=True))
        want = expr.xreplace({s: sympy.Integer(values[s]) for s in symbols})
        want = float(bool(want) if want in (sympy.true, sympy.false) else want)
        one = fn({"s0": a, "s1": b})
        got = batched[i] if isinstance(batched, torch.Tensor) else batched
        assert float(got) == pytest.approx(want), (expr, a, b, got, want)
        assert float(one) == pytest.approx(want), (expr, a, b, one, want)
        assert not isinstance(one, torch.Tensor), "static sizes stay Python numbers"


def test_a_zero_divisor_in_a_size_expression_divides_by_one():
    # guards such as Mod(s0, s0**2) are only meaningful for non-empty samples: with a
    # zero divisor map evaluates them as dividing by 1 (for tensors and Python ints)
    from raggedfn._map.base._sizes import compile_expr

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    for expr, want in ((symfn.FloorDiv(s0, s1), [7, 3]), (symfn.Mod(s0, s1), [0, 1])):
        fn = compile_expr(expr)
        assert fn({"s0": torch.tensor([7, 7]), "s1": torch.tensor([0, 2])}).tolist() == want
        assert fn({"s0": 7, "s1": 0}) == want[0]


def _pair(t):
    return t[:, None, :] * t[None, :, :]  # (N, N, D): two ragged axes


@pytest.mark.parametrize(
    "f",
    [
        lambda t: _pair(t)[t.sum(-1) > 0],  # a token mask over the pair state's rows
        lambda t: _pair(t)[(_pair(t).sum(-1) > 0).T],  # a transposed pair mask
    ],
    ids=["token_mask", "transposed_pair_mask"],
)
def test_a_mask_over_a_value_with_two_ragged_axes_loops_and_says_why(f):
    # boolean masks are batched over the token layout only; any other runs that node
    # per sample (as torch) and the report names the reason
    x = tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fallback == {
        "aten.index.Tensor": "a mask over a value with several or inner ragged axes"
    }, str(report)


def test_matmul_over_a_ragged_batch_axis_loops_and_says_why():
    x = tokens()

    def f(t):
        return _pair(t) @ _pair(t).transpose(-1, -2)  # batched over the first ragged axis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fallback == {"aten.matmul.default": "matmul with ragged batch axes"}, str(report)


def test_an_in_place_write_through_a_view_of_a_shared_argument_runs_once_per_sample():
    # w.unbind(0)[0] is a view of the argument w (through a multi-output op and getitem):
    # the loop adds 1 to w[0] once per sample, so later samples see the earlier writes
    x = tokens()

    def f(t, w):
        w.unbind(0)[0].add_(1)
        return t * w.sum()

    mapped, looped = weights(2, D), weights(2, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, x, mapped, in_dims=(0, None))
    assert_same(report.output, [f(t, looped) for t in raggedfn.unbind(x)])
    assert torch.equal(mapped, looped)
    assert "writes into an argument of f" in str(report.whole_loop), str(report)


def test_an_empty_batch_of_a_looped_f_has_the_traced_output_structure():
    # f writes into its argument: the call runs per sample, here for no sample at all.
    # The output is what the loop gives a batch: a Ragged value and a stacked tensor,
    # with the traced layout, dtype and dense sizes, and no samples (and w is unchanged)
    def f(t, w):
        w.add_(1)
        return t * w, (t * w).sum(0)

    w = torch.zeros(D, dtype=torch.float64)
    empty = raggedfn.from_lengths(
        torch.zeros(0, D, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        ragged, dense = raggedfn.map(f, empty, w, in_dims=(0, None))
        some = raggedfn.map(f, tokens(), w.clone(), in_dims=(0, None))
    assert isinstance(ragged, raggedfn.Ragged) and ragged.layout == some[0].layout
    raggedfn.check(ragged)
    assert ragged.batch_size == 0 and ragged.values.shape == (0, D)
    assert ragged.sizes.shape == (0, 1) and ragged.values.dtype == torch.float64
    assert dense.shape == (0, D) and dense.dtype == some[1].dtype == torch.float64
    assert torch.equal(w, torch.zeros(D, dtype=torch.float64))


CAPTURED = weights(D, 3, seed=6)


@pytest.mark.parametrize(
    ("f", "tiled"),
    [
        # three row-local ops, then a captured weight read and a product that is not
        # row-local: the chain ends on its last op and runs on row tiles
        (lambda t: (torch.tanh(t) * 2 + 1) @ CAPTURED, True),
        # two row-local ops: shorter than MIN_CHAIN, run op by op
        (lambda t: torch.tanh(t) * 2, False),
    ],
    ids=["chain_before_a_weight_read", "two_ops"],
)
def test_row_tiles_take_chains_of_three_row_local_ops(monkeypatch, f, tiled):
    from raggedfn._map.running import _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 16)  # 4 rows of D = 4 per tile
    x = tokens()
    report = raggedfn.map_report(f, x, chunk_elements=1 << 40)
    assert_same(report.output, loop(f, x))
    assert ("row tiles" in report.batched) == tiled, report.batched


# ----- state f reads: every kind of captured value is guarded (retrace when it changes) --

SCALE_FACTOR = 2.0
_THIS = sys.modules[__name__]


def _reads_a_module_attribute(t):
    return t * _THIS.SCALE_FACTOR  # module.NAME read through a user module


def test_a_number_read_through_a_user_module_is_guarded(monkeypatch):
    x = tokens()
    assert_same(raggedfn.map(_reads_a_module_attribute, x), loop(_reads_a_module_attribute, x))
    monkeypatch.setattr(_THIS, "SCALE_FACTOR", -3.0)
    assert_same(raggedfn.map(_reads_a_module_attribute, x), loop(_reads_a_module_attribute, x))


def test_captured_numpy_arrays_partials_and_large_sets_are_guarded():
    np = pytest.importorskip("numpy")
    x = tokens()
    scale = np.array([1.0, 2.0, 3.0, 4.0])
    shift = functools.partial(torch.add, alpha=2.0)
    chosen = set(range(300))  # more items than the walk compares one by one

    def f(t):
        factor = float(scale.sum()) + (1.0 if 7 in chosen else 0.0)
        return shift(t * factor, 1.0)

    first = raggedfn.map_report(f, x)
    assert_same(first.output, loop(f, x))
    again = raggedfn.map_report(f, x)  # nothing changed: the trace is reused
    assert again.traces == first.traces, (first.traces, again.traces)
    scale[0] = 10.0  # an in-place change of the array: its bytes are guarded
    assert_same(raggedfn.map(f, x), loop(f, x))
    chosen.discard(7)
    assert_same(raggedfn.map(f, x), loop(f, x))


def test_a_per_sample_dense_operand_aligns_to_a_transposed_ragged_value():
    # t.transpose(1, 2) only changes the layout (dense axes stored (3, 4), read (4, 3));
    # the per-sample (4, 3) tensor added to it is permuted to that storage order
    gen = torch.Generator().manual_seed(7)
    x = raggedfn.from_list(
        [torch.randn(n, 3, 4, generator=gen, dtype=torch.float64) for n in LENGTHS]
    )

    def f(t):
        return t.transpose(1, 2) + t.sum(0).transpose(0, 1) * 2

    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_dense_inputs_of_a_new_per_sample_shape_get_their_own_trace():
    # a dense [B, n, 4] input: f's trace is specific to the per-sample shape (n, 4)
    def f(d):
        return d.reshape(-1) @ torch.arange(d.numel(), dtype=d.dtype)

    gen = torch.Generator().manual_seed(8)
    for n in (3, 5, 3):
        d = torch.randn(2, n, 4, generator=gen, dtype=torch.float64)
        got = raggedfn.map(f, d)
        torch.testing.assert_close(got, torch.stack([f(s) for s in d]))


# ----- output structure, guards from torch's own code, deep state (survivors of 2026-12-03) --


def _assert_columns(outputs, expected):
    """Each output of ``map`` equals the per-sample column of ``expected``."""
    assert len(outputs) == len(expected[0])
    for j, leaf in enumerate(outputs):
        assert_same(leaf, [e[j] for e in expected])


def _pinned_on_three_inputs(a, b, c):
    return a * len(a), c[0] + b.sum(0)  # len() pins a's size; c[0] needs a row


def test_a_pinned_function_of_three_size_classes_gets_its_structure_from_a_small_probe():
    # len(a) fixes the first trace's size of a, so a probe trace on small sizes runs
    # (docs/map.md: 2, 3, 4, ... per size class, never 0 or 1, torch's special cases);
    # it completes, so the structure comes from f: a probe on an empty c would stop at
    # c[0] and leave the structure unknown (None)
    a, b, c = tokens((5, 3)), tokens((2, 4), seed=1), tokens((3, 2), seed=2)
    report = raggedfn.map_report(_pinned_on_three_inputs, a, b, c)
    _assert_columns(report.output, loop(_pinned_on_three_inputs, a, b, c))
    assert report.structure == [(0,), ()], report.structure


def _pinned_then_indexed(t):
    return t.new_zeros(len(t)) + t[2, 0], t[2]  # the row count follows len(t)


def test_a_pinned_trace_whose_probe_stops_claims_no_structure():
    # the probe (size 2) stops at t[2]; a trace with a pinned size cannot tell its fixed
    # output sizes from ragged ones alone (new_zeros(len(t)) has 5 rows in a trace on 5),
    # so MapReport.structure is None rather than a structure that calls axis 0 fixed
    x = tokens((4, 6, 3))
    report = raggedfn.map_report(_pinned_then_indexed, x)
    expected = loop(_pinned_then_indexed, x)
    _assert_columns(report.output, expected)
    assert isinstance(report.output[0], raggedfn.Ragged)  # 4, 6 and 3 rows
    structure = report.structure
    for j, column in enumerate(zip(*expected, strict=True)):
        differ = {a for a in range(column[0].ndim) if len({c.shape[a] for c in column}) > 1}
        assert structure is None or differ <= set(structure[j]), (j, structure)


def _pinned_then_sliced(t):
    return t[2:-3], float(t.shape[0])  # no rows for n <= 5, n - 5 rows past it


def test_a_pinned_slice_empty_at_both_example_sizes_is_still_ragged():
    # float(n) pins each trace's size; t[2:-3] has no rows at the first trace's size (5)
    # and the probe's (2): only a third, larger size shows the rows follow the sample's.
    # Found by the generated programs (seed 3248284509, program 753): a batch of short
    # samples gave a dense [B, 0, D] tensor where longer ones give a Ragged value
    for lengths in ((3, 1), (8, 1), (3, 3)):
        x = tokens(lengths)
        report = raggedfn.map_report(_pinned_then_sliced, x)
        assert report.structure is not None and report.structure[0] == (0,), report.structure
        assert isinstance(report.output[0], raggedfn.Ragged), lengths
        expected = loop(_pinned_then_sliced, x)
        assert_same(report.output[0], [e[0] for e in expected])
        assert report.output[1].tolist() == [e[1] for e in expected]


def test_batch_norm_refuses_a_one_row_sample_in_training_as_the_loop_does():
    # torch's F.batch_norm checks `size_prods == 1` in Python (_verify_batch_size): a
    # guard Ne(n, 1) from torch's own frame that decides an error, not a layout, so it is
    # checked per sample (only size-1 guards of matmul/broadcasting frames are layout)
    def f(t):
        return F.batch_norm(t, None, None, training=True)

    x = tokens((3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        assert_same(raggedfn.map(f, x), loop(f, x))
        one = tokens((3, 1, 2), seed=3)
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            loop(f, one)
        with pytest.raises(ValueError, match="more than 1 value per channel") as error:
            raggedfn.map(f, one)
    assert not isinstance(error.value, raggedfn.RaggedError)  # torch's own error
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]


def _class_chain(levels, leaf):
    chain = type("Level0", (), {"w": leaf})
    for level in range(1, levels + 1):
        chain = type(f"Level{level}", (), {"inner": chain})
    return chain


SHALLOW = _class_chain(2, weights(D, seed=9))
DEEP = _class_chain(11, weights(D, seed=10))


def _reads_shallow(t):
    return t * SHALLOW.inner.inner.w


def _reads_deep(t):
    return t * DEEP.inner.inner.inner.inner.inner.inner.inner.inner.inner.inner.inner.w


def test_class_attributes_count_towards_the_depth_limit_of_the_walk():
    # docs/map.md: objects more than 10 levels deep are not followed; a tensor the trace
    # uses that the walk did not find cannot be re-read, so f is traced again at every
    # call, with a warning. Each class attribute is one level, as any other attribute.
    x = tokens()
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RaggedPerformanceWarning)
            assert_same(raggedfn.map(_reads_shallow, x), loop(_reads_shallow, x))
    assert raggedfn.map_cache_info(_reads_shallow).traces == 1
    SHALLOW.inner.inner.w.mul_(-2)  # found by the walk: lifted, read afresh
    assert_same(raggedfn.map(_reads_shallow, x), loop(_reads_shallow, x))
    before = raggedfn.map_cache_info(_reads_deep).traces
    for _ in range(2):
        with pytest.warns(RaggedPerformanceWarning, match="does not follow"):
            assert_same(raggedfn.map(_reads_deep, x), loop(_reads_deep, x))
    assert raggedfn.map_cache_info(_reads_deep).traces == before + 2


# ----- survivors of the 2026-12-03 afternoon run (seed 20, 150 drawn) ---------------------


def test_type_as_of_a_ragged_value_casts_its_values_as_torch():
    x = tokens()

    def f(t):
        return t.float().type_as(t) * 2  # a ragged float32 value cast back to t's dtype

    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.output.dtype == torch.float64


def test_a_dense_axis_reduction_keeps_its_dtype_argument():
    x = raggedfn.from_list([s.float() for s in raggedfn.unbind(tokens())])

    def f(t):
        return t.sum(1, dtype=torch.float64), t.mean(-1, dtype=torch.float64)

    report = raggedfn.map_report(f, x)
    _assert_columns(report.output, loop(f, x))
    assert all(o.dtype == torch.float64 for o in report.output)


HEAD, TAIL = weights(2, D, seed=11), weights(3, D, seed=12)


def test_cat_along_the_ragged_axis_with_fixed_pieces_of_two_sizes():
    # pieces of fixed sizes 2 and 3 along the ragged axis: each gets its own partition
    x = tokens()

    def f(t):
        return torch.cat([HEAD, t, TAIL]) * 2

    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_row_tiles_of_featureless_rows(monkeypatch):
    from raggedfn._map.running import _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 16)
    x = raggedfn.from_list([torch.zeros(n, 0, dtype=torch.float64) for n in (10, 9, 5)])

    def f(t):
        return torch.tanh(t) * 2 + 1

    report = raggedfn.map_report(f, x, chunk_elements=1 << 40)
    assert_same(report.output, loop(f, x))


def test_a_chain_reading_a_per_sample_dense_value_runs_step_by_step(monkeypatch):
    # tiles take ragged values of the chain's rows and shared weights; a per-sample
    # dense operand (t.sum(0), one row per sample) sends the chain back to the plain path
    from raggedfn._map.running import _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 16)
    x = tokens((6, 0, 5, 7))

    def f(t):
        return (torch.tanh(t) * t.sum(0) + 1) * 2

    report = raggedfn.map_report(f, x, chunk_elements=1 << 40)
    assert_same(report.output, loop(f, x))


def test_a_per_sample_dense_result_expanded_to_a_fixed_shape():
    x = tokens()

    def f(t):
        return t.sum(0).expand(3, D) * 1.5, t.sum(0, keepdim=True).expand(2, D)

    report = raggedfn.map_report(f, x)
    _assert_columns(report.output, loop(f, x))


def test_gather_out_of_range_names_the_first_sample_that_asks():
    x = tokens((3, 2, 4))
    index = raggedfn.from_list(
        [torch.tensor([[0] * D, [2] * D]), torch.tensor([[1] * D]), torch.tensor([[3] * D])]
    )

    def f(t, i):
        return torch.gather(t, 0, i)

    assert_same(raggedfn.map(f, x, index), loop(f, x, index))
    bad = raggedfn.from_list(
        [torch.tensor([[0] * D]), torch.tensor([[0, 2, 0, 0], [0] * D]), torch.tensor([[3] * D])]
    )
    with pytest.raises(RuntimeError) as want:
        loop(f, x, bad)  # sample 1 has 2 rows
    with pytest.raises(RuntimeError, match="index 2 is out of bounds") as error:
        raggedfn.map(f, x, bad)  # torch's own error, as the loop raises it
    assert str(error.value) == str(want.value)
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]


def test_randomness_error_holds_for_samples_that_run_per_sample():
    # len(t) pins the size: each length needs a plan of its own, four at most, so the
    # samples of the fifth and sixth lengths run per sample; only they draw, and
    # randomness="error" refuses the draw there as in a batched plan
    x = tokens((5, 2, 4, 3, 6, 7))

    def f(t):
        return t * 2 if len(t) <= 5 else t + torch.rand(D, dtype=t.dtype)

    short = tokens((5, 2, 4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        assert_same(raggedfn.map(f, short, randomness="error"), loop(f, short))
        with pytest.raises(raggedfn.RaggedError, match="randomness='error'"):
            raggedfn.map(f, x, randomness="error")


# ----- map's branch under torch.compile, run eagerly --------------------------------------
# Compiled tests cannot run under mutmut (dynamo does not trace its trampolines). With
# torch.compiler.is_compiling() patched to True, map takes that branch (compiled_map:
# the variant found by its coarse signature, or traced on the spot) and every step of it
# but dynamo's own hooks (comptime, a no-op eagerly) runs, as the attention body of
# test_prims_bodies.py does. tests/test_map_compile.py compiles the same paths for real.


class Pair(typing.NamedTuple):
    tokens: raggedfn.Ragged
    gates: raggedfn.Ragged


def _gated(p, scale):
    return torch.tanh(p.tokens) * p.gates * scale


def _weighted(t, w, d):
    return (t @ w).sum(0) + d


def _guarded(t):
    return t * 2 if t.shape[0] > 2 else t - 1


def _peak(t):
    return t.amax(0)


def _reads_captured(t):
    return torch.tanh(t @ CAPTURED)  # a captured tensor: lifted, its state checked


def _dynamo_branch(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


def test_the_dynamo_branch_of_map_run_eagerly_equals_the_loop(monkeypatch):
    x, w = tokens(), weights(D, 3)
    d = weights(len(LENGTHS), 3, seed=4)
    _dynamo_branch(monkeypatch)
    # traced on the spot (no variant yet): ragged, shared and per-sample dense inputs
    got = raggedfn.map(_weighted, x, w, d, in_dims=(0, None, 0))
    want = [_weighted(t, w, row) for t, row in zip(raggedfn.unbind(x), d, strict=True)]
    torch.testing.assert_close(got, torch.stack(want))
    # a ragged input alone (a guard that every sample meets), then the variant found again
    x = tokens((3, 5, 4))
    for _ in range(2):
        assert_same(raggedfn.map(_guarded, x), loop(_guarded, x))
        assert_same(raggedfn.map(_reads_captured, x), loop(_reads_captured, x))


def test_the_dynamo_branch_finds_a_variant_an_eager_call_made(monkeypatch):
    # a NamedTuple argument: its structure is not one the compiled branch can describe to
    # trace on the spot, so only the variant of the eager call serves it
    pair, scale = Pair(tokens(), tokens(seed=5)), torch.tensor(3.0, dtype=torch.float64)
    samples = zip(raggedfn.unbind(pair.tokens), raggedfn.unbind(pair.gates), strict=True)
    want = [_gated(Pair(t, g), scale) for t, g in samples]
    assert_same(raggedfn.map(_gated, pair, scale, in_dims=(0, None)), want)
    _dynamo_branch(monkeypatch)
    assert_same(raggedfn.map(_gated, pair, scale, in_dims=(0, None)), want)
    fresh = Pair(pair.tokens.float(), pair.gates.float())  # another dtype: no variant
    with pytest.raises(raggedfn.RaggedError, match="no trace for this input signature"):
        raggedfn.map(_gated, fresh, scale.float(), in_dims=(0, None))


def test_the_dynamo_branch_checks_guards_and_empty_samples_in_the_graph(monkeypatch):
    # no per-sample loop inside a graph: a sample failing a guard, or a reduction torch
    # refuses on an empty sample, stops the batch with an assert instead
    x = tokens((3, 4))
    assert_same(raggedfn.map(_guarded, x), loop(_guarded, x))
    assert_same(raggedfn.map(_peak, x), loop(_peak, x))
    _dynamo_branch(monkeypatch)
    assert_same(raggedfn.map(_guarded, x), loop(_guarded, x))
    with pytest.raises(RuntimeError, match=r"raggedfn.map: guard .* fails"):
        raggedfn.map(_guarded, tokens((3, 1)))
    with pytest.raises(RuntimeError, match="amax"):
        raggedfn.map(_peak, tokens((3, 0, 2)))


def _closure_after_an_empty_cell():
    a_gone = None
    del a_gone  # an empty cell, before b_scale among f's free variables (sorted by name)
    b_scale = 2.0

    def f(t):
        if t.ndim > 5:
            return a_gone  # noqa: F821 (never taken: the cell stays empty)
        return t * b_scale

    def rescale(value):
        nonlocal b_scale
        b_scale = value

    return f, rescale


def test_a_closure_cell_after_an_empty_one_is_guarded():
    f, rescale = _closure_after_an_empty_cell()
    assert f.__code__.co_freevars == ("a_gone", "b_scale")
    x = tokens()
    assert_same(raggedfn.map(f, x), loop(f, x))
    rescale(-3.0)
    assert_same(raggedfn.map(f, x), loop(f, x))


class _Settings(torch.nn.Module):
    pass


_SCALE_CELL = [2.0]  # 10 levels from f: f, SETTINGS, .config, 8 dicts, the list
SETTINGS = _Settings()
SETTINGS.config = functools.reduce(lambda inner, _: {"next": inner}, range(8), _SCALE_CELL)


def _reads_settings(t):
    level = SETTINGS.config
    while isinstance(level, dict):
        level = level["next"]
    return t * level[0]


def test_state_ten_levels_deep_through_a_module_attribute_is_followed():
    # docs/map.md: objects up to 10 levels deep are followed (deeper ones are compared by
    # identity); a module's plain attribute is one level, like any other attribute
    x = tokens()
    assert_same(raggedfn.map(_reads_settings, x), loop(_reads_settings, x))
    try:
        _SCALE_CELL[0] = -3.0  # an in-place change, 10 levels down
        assert_same(raggedfn.map(_reads_settings, x), loop(_reads_settings, x))
    finally:
        _SCALE_CELL[0] = 2.0


def test_strict_refuses_the_loop_for_a_sample_empty_in_one_input_only():
    # len(t) pins t's size: four plans (lengths 5, 2, 4, 3), then the sample of length 6
    # runs per sample; its u is empty but its t is not, so it is not a sample without
    # elements (those may run per sample under strict=True: they cost nothing)
    x, u = tokens((5, 2, 4, 3, 6)), tokens((1, 1, 1, 1, 0), seed=3)

    def f(t, v):
        return t.sum(0) * len(t) + v.sum(0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        assert_same(raggedfn.map(f, x, u), loop(f, x, u))
    with pytest.raises(
        raggedfn.RaggedError, match=r"the trace of f holds only under .* 1 sample.*strict=True"
    ):
        raggedfn.map(f, x, u, strict=True)


def test_the_report_lists_each_per_sample_loop_with_its_reason():
    # a shared weight cast to the sample's dtype stays shared (type_as batches); a flip
    # has no batching rule and runs per sample (correct, reported as such)
    x, w = tokens(), weights(D).float()

    def f(t):
        return torch.flip(w.type_as(t) + t, [0])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fallback == {"aten.flip.default": "no batching rule"}
    assert report.batched.get("aten.type_as.default") == 1
    lines = str(report).splitlines()
    start = lines.index("  per-sample loop (no batching rule):")
    assert lines[start + 1] == "    aten.flip.default: no batching rule"


def test_groups_of_samples_read_a_captured_tensor():
    # a small chunk budget runs the samples in groups, each reading the captured weight
    x = tokens((3, 5, 4, 6))
    for chunk in (16, 0):
        got = raggedfn.map(_reads_captured, x, chunk_elements=chunk)
        assert_same(got, loop(_reads_captured, x))


_PARTIAL_CELL = [2.0]  # 10 levels from the partial: .func, SETTINGS_7, .config, 7 dicts
SETTINGS_7 = _Settings()
SETTINGS_7.config = functools.reduce(lambda inner, _: {"next": inner}, range(7), _PARTIAL_CELL)


def _reads_settings_7(t, offset):
    level = SETTINGS_7.config
    while isinstance(level, dict):
        level = level["next"]
    return t * level[0] + offset


def test_state_ten_levels_deep_through_a_partial_is_followed():
    # a partial's function is one level below the partial, like any attribute
    f = functools.partial(_reads_settings_7, offset=1.0)
    x = tokens()
    assert_same(raggedfn.map(f, x), loop(f, x))
    try:
        _PARTIAL_CELL[0] = -3.0  # an in-place change, 10 levels down
        assert_same(raggedfn.map(f, x), loop(f, x))
    finally:
        _PARTIAL_CELL[0] = 2.0


# ----- survivors of the seed-1206 draw (2026-12-06) -----------------------------------------


def test_attention_of_fixed_shape_samples_keeps_the_scale():
    # dense per-sample [H, N, D] inputs: one kernel call over the merged batch, as the loop
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 4, generator=gen, dtype=torch.float64)

    def f(t):
        return F.scaled_dot_product_attention(t, t * 0.5, t, scale=0.3)

    report = raggedfn.map_report(f, x)
    torch.testing.assert_close(report.output, torch.stack([f(t) for t in x]))
    assert report.fully_batched, str(report)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t.argmax(1),
        lambda t: torch.prod(t, 1),
        lambda t: t.max(1).values,
        lambda t: t.logsumexp(1),
    ],
)
def test_reductions_over_a_dense_axis_with_an_int_dim_batch_like_the_loop(f):
    # ops whose schema takes an int dim (argmax, prod, max) get an int, not a list
    x = tokens()
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_attention_dropout_passed_positionally_is_a_random_op():
    # F.scaled_dot_product_attention(q, k, v, None, 0.5): dropout_p is the fifth argument
    gen = torch.Generator().manual_seed(0)
    x = raggedfn.from_list([torch.randn(n, 2, 4, generator=gen) for n in (3, 5)])

    def f(t):
        h = t.transpose(0, 1)
        return F.scaled_dot_product_attention(h, h, h, None, 0.5).transpose(0, 1)

    with pytest.raises(raggedfn.RaggedError, match="randomness"):
        raggedfn.map(f, x, randomness="error")


def test_reducing_one_of_three_ragged_axes_batches_like_the_loop():
    # (N, N, N, D) summed over its first axis: two ragged axes kept, each output row's
    # index built from both kept coordinates
    x = tokens((3, 0, 2, 4))

    def f(t):
        return (t[:, None, None, :] * t[None, :, None, :] + t[None, None, :, :]).sum(0)

    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_an_out_of_range_gather_in_the_dynamo_branch_says_which_op(monkeypatch):
    # inside the graph the range check is an on-device assertion with map's message
    x = tokens((3, 5))
    _dynamo_branch(monkeypatch)
    with pytest.raises(RuntimeError, match="gather: a position is out of range for its sample"):
        raggedfn.map(lambda t: torch.gather(t, 1, torch.full((1, 1), 9).expand(t.shape[0], D)), x)


class Scaled(typing.NamedTuple):
    tokens: raggedfn.Ragged
    scale: torch.Tensor  # [B, D]: a dense per-sample leaf


def _scaled(p):
    return torch.tanh(p.tokens) * p.scale


def test_the_dynamo_branch_finds_the_variant_of_a_dense_per_sample_leaf(monkeypatch):
    # a NamedTuple cannot be traced on the spot: the eager call's variant must be found,
    # its signature giving the dense leaf's per-sample rank
    pair = Scaled(tokens(), weights(len(LENGTHS), D, seed=6))
    samples = zip(raggedfn.unbind(pair.tokens), pair.scale, strict=True)
    want = [_scaled(Scaled(t, s)) for t, s in samples]
    assert_same(raggedfn.map(_scaled, pair), want)
    _dynamo_branch(monkeypatch)
    assert_same(raggedfn.map(_scaled, pair), want)


def _scores_against_the_first_three(t):
    return t @ t.narrow(0, 0, min(3, t.shape[0])).T  # (n, min(3, n))


def test_the_dynamo_branch_makes_a_trailing_fixed_axis_ragged_as_eagerly(monkeypatch):
    # the plan under the guard n >= 3 has a fixed second axis (3): the output structure
    # (two ragged axes, as eagerly) makes it ragged from shapes alone
    # (tests/test_map_compile_structure.py compiles the same for real)
    x = tokens((5, 6))
    eager = raggedfn.map(_scores_against_the_first_three, x)
    assert eager.num_ragged == 2
    _dynamo_branch(monkeypatch)
    for lengths in ((5, 6), (3, 4, 7), (4, 3)):
        x = tokens(lengths)
        got = raggedfn.map(_scores_against_the_first_three, x)
        assert isinstance(got, raggedfn.Ragged) and got.layout == eager.layout
        assert_same(got, loop(_scores_against_the_first_three, x))


def _scaled_by(t, c):
    return torch.tanh(t) * c


def test_the_dynamo_branch_picks_the_variant_of_the_same_python_constant(monkeypatch):
    # a Python number (in_dims=None) is a constant of its trace: the variant an eager call
    # made with 2.0 serves 2.0 only; 3.0 is traced on the spot
    x = tokens()
    assert_same(raggedfn.map(_scaled_by, x, 2.0, in_dims=(0, None)), loop(_scaled_by, x, 2.0))
    _dynamo_branch(monkeypatch)
    for c in (2.0, 3.0, 2.0):
        got = raggedfn.map(_scaled_by, x, c, in_dims=(0, None))
        assert_same(got, [_scaled_by(t, c) for t in raggedfn.unbind(x)])
