"""``raggedfn.map`` behaviour that ``make mutate`` found untested: the nested record's
batched ops and per-sample sizes given by a power (docs/testing.md).

Each test compares ``map`` with the per-sample loop and checks how the call ran
(``map_report``); each was seen failing with the surviving mutant applied.
"""

from __future__ import annotations

import sympy
import torch
import torch.utils._sympy.functions as symfn

import raggedfn
from property_tests.map_oracle import assert_restacked
from property_tests.reference import assert_same, loop

D = 3


def _documents(seed=0):
    """Sentences of tokens per document: an empty document, an empty sentence."""
    gen = torch.Generator().manual_seed(seed)
    shape = [[2, 3], [], [1], [0, 4]]
    return raggedfn.from_list(
        [[torch.randn(n, D, generator=gen, dtype=torch.float64) for n in doc] for doc in shape]
    )


def _doc_loop(f, x):
    return [f(x[i]) for i in range(x.batch_size)]


def test_ops_with_a_number_before_the_sample_are_batched_on_nested_values():
    # kills _record_ops.x_handle__mutmut_32 (_batch_args given None for the op's name):
    # ops without an axis pass their arguments through unchanged; bound by signature
    # instead, ``2.0 - doc`` (sub(2.0, doc)) and ``where(mask, 0.5, doc)`` have a
    # number as ``x`` and the record gives up (the whole function ran per sample)
    x = _documents()
    for f in (
        lambda doc: raggedfn.sum(2.0 - doc, 1),
        lambda doc: raggedfn.sum(raggedfn.where(doc > 0, 0.5, doc), 1),
    ):
        report = raggedfn.map_report(f, x)
        assert_restacked(report.output, _doc_loop(f, x))
        assert report.fully_batched, str(report)


def test_a_size_two_to_the_length_is_batched():
    # kills _sizes.x_compile_expr__mutmut_35 (PowByNatural evaluated to None):
    # 2 ** len(t) stays PowByNatural(2, s0) in the trace (a symbolic exponent; an
    # integer one becomes sympy's Pow), and the plan evaluates it per sample
    gen = torch.Generator().manual_seed(0)
    x = raggedfn.from_list(
        [torch.randn(n, D, generator=gen, dtype=torch.float64) for n in (3, 0, 5, 1)]
    )

    def f(t):
        return t.new_ones(2 ** t.shape[0]) * t.sum()

    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_a_power_by_natural_size_evaluates_as_sympy():
    # kills _sizes.x_compile_expr__mutmut_35 at the evaluator itself, on [B] size
    # tensors and on Python ints (tests/test_map_mutants.py's PowByNatural(s0, 3)
    # is folded to sympy's Pow by sympy before compile_expr sees it)
    from raggedfn._map.base._sizes import compile_expr

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    expr = symfn.PowByNatural(s1, s0)
    assert type(expr) is symfn.PowByNatural
    firsts, seconds = [5, 2, 0, 3], [3, 2, 7, 1]
    fn = compile_expr(expr)
    batched = fn({"s0": torch.tensor(firsts), "s1": torch.tensor(seconds)})
    want = [int(expr.xreplace({s0: a, s1: b})) for a, b in zip(firsts, seconds, strict=True)]
    assert batched.tolist() == want
    assert fn({"s0": 5, "s1": 3}) == 3**5
