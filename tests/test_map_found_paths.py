"""``raggedfn.map`` behaviour that ``make mutate`` (seed 71206, the ``map`` slice) found
untested (docs/testing.md).

Each test compares ``map`` with the per-sample loop or asserts how the call ran
(``map_report``, a spied path); each was seen failing with its surviving mutant applied.
"""

from __future__ import annotations

import warnings

import torch

import raggedfn
from property_tests.reference import assert_same

D = 4


def _documents() -> raggedfn.Ragged:
    """Tokens per sentence of every document: a nested value ``(B, S*, L*, D)`` with an
    empty document and an empty sentence."""
    shape = [[2, 3], [], [1], [0, 4, 2], [3]]
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(sum(map(sum, shape)), D, generator=gen, dtype=torch.float64)
    rows = [n for doc in shape for n in doc]
    return raggedfn.from_nested_lengths(values, [[len(d) for d in shape], rows])


@torch.library.custom_op("raggedfn_test_mutants::triple_no_fake", mutates_args=())
def _triple_no_fake(t: torch.Tensor) -> torch.Tensor:
    """An op with no fake implementation: it runs eagerly and cannot be traced."""
    return t * 3


def test_a_segment_that_cannot_be_traced_says_why_in_the_nested_report():
    # the torch code between raggedfn ops (one segment) runs through one-level map, whose
    # trace fails on the op with no fake implementation: that segment runs per sample and
    # the nested report names it with the trace's reason
    x = _documents()

    def f(doc):
        return _triple_no_fake(torch.tanh(raggedfn.sum(doc, 1)))

    report = raggedfn.map_report(f, x)
    assert report.whole_loop is None and not report.fully_batched
    where = "segment 0 of torch code on per-sample tensors"
    assert list(report.fallback) == [where], report.fallback
    why = report.fallback[where]
    assert isinstance(why, str) and why.startswith("tracing failed") and "fake" in why, why
    assert_same(report.output, [f(x[i]) for i in range(x.batch_size)])


def test_a_per_sample_shape_passed_to_torch_is_named_in_the_reason():
    # torch.zeros(s.shape) with s's rows following the sample: the record stops and the
    # report says which torch function was handed the shape
    x = _documents()

    def f(doc):
        return torch.zeros(raggedfn.sum(doc, 1).shape)

    report = raggedfn.map_report(f, x)
    assert report.whole_loop is not None
    assert "f passes a per-sample shape to" in report.whole_loop, report.whole_loop
    assert "zeros" in report.whole_loop, report.whole_loop
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        got = raggedfn.map(f, x)
    assert_same(got, [f(x[i]) for i in range(x.batch_size)])


def _tokens(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in lengths]
    )


def _loop(f, x):
    return [f(s) for s in raggedfn.unbind(x)]


def test_the_output_of_a_batched_call_is_built_without_checking_it_again(monkeypatch):
    # the interpreter's Ragged results have an input's offsets and sizes: to_output builds
    # them without the dataclass's checks (check_structure runs for no output)
    from raggedfn import _ragged

    x = _tokens((3, 0, 5))

    def f(t):
        return torch.tanh(t) * 2

    checked: list[str] = []
    original = _ragged.check_structure

    def spy(*args, **kwargs):
        checked.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(_ragged, "check_structure", spy)
    for _ in range(2):  # the first call and the warm one
        out = raggedfn.map(f, x)
        assert checked == [], checked
    report = raggedfn.map_report(f, x)
    assert checked == [], checked
    monkeypatch.undo()
    assert report.fully_batched, str(report)
    assert_same(out, _loop(f, x))
    assert_same(report.output, _loop(f, x))


def test_empty_samples_that_no_trace_fits_run_per_sample_without_a_warning():
    # a batch whose samples are all empty and fail the first plan's guards: the retrace on
    # an empty sample fails, they run per sample, and (costing nothing) say nothing

    def f(t):  # a sample without rows reads its (empty) data: no trace on it
        if len(t) == 0:
            return t.sum(0) * float(t.sum())
        return t.sum(0) * 2

    raggedfn.map(f, _tokens((3, 5)))
    x = _tokens((0, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", raggedfn.RaggedPerformanceWarning)
        got = raggedfn.map(f, x)
    assert_same(got, _loop(f, x))
    report = raggedfn.map_report(f, x)
    assert report.whole_loop is not None and "fails for 2 sample(s)" in report.whole_loop


def test_a_failed_retrace_on_an_empty_sample_is_not_tried_again(monkeypatch):
    # once the retrace on an empty sample failed, later calls run empty samples per
    # sample without tracing f again
    from raggedfn._map.caching import _groups

    def f(t):  # as above (map's cache is per code: another function)
        if len(t) == 0:
            return t.sum(0) * float(t.sum()) + 1
        return t.sum(0) * 3

    raggedfn.map(f, _tokens((3, 5)))
    x = _tokens((0, 2, 0))
    traced: list[int] = []
    original = _groups.trace_plan

    def spy(*args, **kwargs):
        traced.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_groups, "trace_plan", spy)
    got = raggedfn.map(f, x)
    assert len(traced) == 1, traced  # the retrace on the first empty sample: it fails
    assert_same(got, _loop(f, x))
    for _ in range(2):
        got = raggedfn.map(f, x)
        assert len(traced) == 1, traced
        assert_same(got, _loop(f, x))


def test_an_op_reading_another_ragged_axis_stays_out_of_a_row_tile_chain(monkeypatch):
    # linear(a, b) with b a per-sample [m, D] weight: its result [n, m] has a ragged
    # operand of another ragged prefix, so the chain of row tiles starts after it (tanh,
    # mul, add) and runs on tiles; equal to the loop
    import torch.nn.functional as F

    from property_tests.reference import loop
    from raggedfn._map.running import _blocks, _tiles

    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 16)
    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)  # tiles smaller than any weight
    x = _tokens((3, 0, 5, 2), seed=1)
    y = _tokens((2, 4, 1, 6), seed=2)

    def f(a, b):
        return torch.tanh(F.linear(a, b)) * 2 + 1

    report = raggedfn.map_report(f, x, y, chunk_elements=1 << 40)
    assert report.batched.get("row tiles", 0) == 1, report.batched
    assert_same(report.output, loop(f, x, y))


class _SlottedScale:
    """A captured object with slots (one of them the weak-reference slot)."""

    __slots__ = ("__weakref__", "scale")

    def __init__(self, scale: float) -> None:
        self.scale = scale


def test_a_captured_object_with_slots_is_checked_by_its_slots():
    # f reads a slot of a captured object: a new value there is a new trace (the check
    # follows the slot); a weak reference taken to the object is no change of f's
    # inputs (the weak-reference slot is not followed): no trace again
    import weakref

    cfg = _SlottedScale(2.0)

    def f(t):
        return t * cfg.scale

    x = _tokens((3, 0, 5))
    report = raggedfn.map_report(f, x)
    assert report.traces == 1 and report.fully_batched, str(report)
    assert_same(report.output, _loop(f, x))
    cfg.scale = 3.0
    report = raggedfn.map_report(f, x)
    assert report.traces == 2, report.traces
    assert_same(report.output, _loop(f, x))
    ref = weakref.ref(cfg)
    report = raggedfn.map_report(f, x)
    assert report.traces == 2, report.traces
    assert_same(report.output, _loop(f, x))
    assert ref() is cfg


def test_the_dynamo_branch_over_a_nested_value_run_eagerly_replays_a_record(monkeypatch):
    # map's branch under torch.compile for nested values (entry/_compiled_nested.py), run
    # eagerly with is_compiling() patched to True: f is recorded once on the arguments'
    # structure and the record replayed (raggedfn.sum one level deeper, the torch code as
    # a one-level map); equal to the loop
    from raggedfn._map.entry import _compiled_nested

    x = _documents()

    def f(doc):
        return torch.tanh(raggedfn.sum(doc, 1)) * 2

    want = [f(x[i]) for i in range(x.batch_size)]
    replayed = []
    real = _compiled_nested.run
    monkeypatch.setattr(
        _compiled_nested, "run", lambda program, *a: replayed.append(program) or real(program, *a)
    )
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = raggedfn.map(f, x)
    monkeypatch.undo()
    assert len(replayed) == 1 and replayed[0].failure is None, replayed
    assert_same(got, want)


def test_export_over_two_ragged_inputs_of_equal_lengths_traces_them_as_one_size():
    # torch.export traces map on fake inputs (entry/_compiled.py's _trace): no data says
    # that x and y have equal lengths, the trace with unrelated sizes fails (x * y), and
    # map traces them again as one size; the program equals the loop on new batches
    class Pair(torch.nn.Module):
        def forward(self, x, y):
            return raggedfn.map(lambda a, b: (a * b).sum(0), x, y)

    x, y = _tokens((3, 5, 4), seed=3), _tokens((3, 5, 4), seed=4)
    spec = (raggedfn.dynamic_shapes(x), raggedfn.dynamic_shapes(y))
    program = torch.export.export(Pair(), (x, y), dynamic_shapes=spec).module()
    for seed, lengths in enumerate([(2, 7), (6, 0, 3)]):
        x, y = _tokens(lengths, seed=seed), _tokens(lengths, seed=seed + 10)
        pairs = zip(raggedfn.unbind(x), raggedfn.unbind(y), strict=True)
        want = [(a * b).sum(0) for a, b in pairs]
        assert_same(program(x, y), want)


def test_size_one_special_cases_inside_einsum_are_not_kept_as_guards():
    # einsum's kernel compares the ragged size with 1 (squeeze or broadcast a size-1
    # axis: the same values); stride_only reads where torch made the guard (its
    # framework frame) and drops it: no Ne(s, 1) among the plan's guards
    import re

    x = _tokens((3, 1, 5, 0))

    def f(t):
        return torch.einsum("nd,ne->de", t, t)

    report = raggedfn.map_report(f, x)
    assert report.fully_batched and report.traces == 1, str(report)
    ones = [g for g in report.guards if re.search(r"Ne\(s\d+, 1\)", g)]
    assert ones == [], report.guards
    assert_same(report.output, _loop(f, x))


def test_a_data_dependent_size_of_shared_values_is_the_same_for_every_sample():
    # w[w > 0] of a tensor every sample shares runs once (not batched) and makes a
    # data-dependent size: map read it from that result (it raised "made a
    # data-dependent size its rule did not define"); cold, warm and with another count
    def f(t, w):  # batched but for the shared ops
        k = w[w > 0]
        return t.sum() * k.sum() + k.shape[0]

    def g(t, w):  # the new size as an axis of the per-sample result: [u0]
        k = w[w > 0]
        return (t.sum(-1, keepdim=True) * k).sum(0)

    x = _tokens((3, 1, 5, 0))
    for values in ([1.0, -1.0, 2.0, 3.0], [1.0, -1.0, 2.0, 3.0], [-1.0, 4.0, -2.0, -3.0]):
        w = torch.tensor(values, dtype=torch.float64)
        report = raggedfn.map_report(f, x, w, in_dims=(0, None))
        assert report.fully_batched and "aten.index.Tensor" in report.unbatched, str(report)
        assert_same(report.output, [f(s, w) for s in raggedfn.unbind(x)])
        for fn in (f, g):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
                got = raggedfn.map(fn, x, w, in_dims=(0, None))
            assert_same(got, [fn(s, w) for s in raggedfn.unbind(x)])


def test_where_with_one_argument_runs_per_sample_and_equals_the_loop():
    # torch.where(condition) (aten.where.default: a tuple of index tensors, data-dependent
    # sizes) reached where's pointwise rule, which crashed with AttributeError; it runs
    # per sample (the report says why), over one-level and nested values
    x = _tokens((3, 1, 5, 0))

    def f(t):
        return torch.where(t[:, 0] > 0)[0] * 2

    report = raggedfn.map_report(f, x)
    why = report.fallback.get("aten.where.default")
    assert why is not None and "where with one argument" in why, report.fallback
    assert_same(report.output, _loop(f, x))
    docs = _documents()

    def g(doc):
        return torch.where(raggedfn.sum(doc, 1)[:, 0] > 0)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        got = raggedfn.map(g, docs)
    assert_same(got, [g(docs[i]) for i in range(docs.batch_size)])
