"""Ops behaviour that ``make mutate`` found untested (docs/testing.md, ops survivors).

Each test compares with torch run on every sample alone (or the error it must raise)
and was seen failing with the surviving mutant applied by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import raggedfn
from raggedfn import RaggedError


def _samples(x: raggedfn.Ragged) -> list[torch.Tensor]:
    return list(raggedfn.unbind(x))


def test_broadcasting_two_values_ragged_along_different_axes_builds_the_outer_partition() -> None:
    # x: (B, N*, 1, D), y: (B, 1, M*, D): the result (B, N*, M*, D) has a partition
    # that neither operand holds, built from x's N and y's M (the owners of each axis)
    gen = torch.Generator().manual_seed(0)
    ns, ms = [2, 0, 3, 1], [3, 2, 1, 4]
    xs = [torch.randn(n, 1, 2, generator=gen) for n in ns]
    ys = [torch.randn(1, m, 2, generator=gen) for m in ms]
    x = raggedfn.from_list(xs, ragged_dims=(1,))
    y = raggedfn.from_list(ys, ragged_dims=(2,))
    for out in (x + y, y * x, raggedfn.where(x > 0, x, y)):
        assert out.shape[1:] == x.shape[1:2] + y.shape[2:]
        assert out.sizes.tolist() == [[n, m] for n, m in zip(ns, ms, strict=True)]
    wants = [
        [a + b for a, b in zip(xs, ys, strict=True)],
        [b * a for a, b in zip(xs, ys, strict=True)],
        [torch.where(a > 0, a, b) for a, b in zip(xs, ys, strict=True)],
    ]
    for out, want in zip((x + y, y * x, raggedfn.where(x > 0, x, y)), wants, strict=True):
        got = _samples(out)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_broadcasting_checks_the_sizes_of_an_axis_two_operands_share() -> None:
    # z is ragged along both axes; x owns the first with other lengths: refused, never
    # gathered with the wrong rows
    x = raggedfn.from_list([torch.ones(2, 1), torch.ones(3, 1)], ragged_dims=(1,))
    y = raggedfn.from_list([torch.ones(1, 2), torch.ones(1, 1)], ragged_dims=(2,))
    z = raggedfn.from_list([torch.ones(3, 2), torch.ones(2, 1)], ragged_dims=(1, 2))
    with pytest.raises(RaggedError, match="sizes along axis 1"):
        x + z
    with pytest.raises(RaggedError, match="sizes along axis 1"):
        raggedfn.where(x > 0, y, z)
    # and the same shapes with matching lengths broadcast as torch does per sample
    x = raggedfn.from_list([torch.full((3, 1), 2.0), torch.full((2, 1), 3.0)], ragged_dims=(1,))
    for got, a, c in zip(_samples(x + z), _samples(x), _samples(z), strict=True):
        assert torch.equal(got, a + c)


def _tokens(lengths: list[int], dim: int = 3, dtype: torch.dtype = torch.float64) -> Any:
    gen = torch.Generator().manual_seed(2)
    return raggedfn.from_list([torch.randn(n, dim, generator=gen, dtype=dtype) for n in lengths])


def _sentences(dim: int, seed: int = 3) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [[torch.randn(n, dim, generator=gen) for n in doc] for doc in ([2, 1], [], [3])]
    )


# errors name the function that was called (DESIGN.md: "naming the function, the
# argument, what was expected and what arrived"), with the text that explains them
ERRORS = {
    "gt_complex_x": (lambda: raggedfn.gt(_tokens([2, 1], dtype=torch.complex64), 0.5), "gt"),
    "gt_complex_y": (lambda: raggedfn.gt(_tokens([2, 1]), 1j), "gt"),
    "where_rank": (
        lambda: raggedfn.where(
            _tokens([2, 1]) > 0, 1.0, raggedfn.from_list([torch.ones(2), torch.ones(1)])
        ),
        "where",
    ),
    "argsort_axis": (lambda: raggedfn.argsort(_tokens([2, 1]), 5), "argsort"),
    "squeeze_axis": (lambda: raggedfn.squeeze(_tokens([2, 1]), 7), "squeeze"),
    # the batch axis alone (reduced_axes is given the name)
    "prod_batch_axis": (lambda: raggedfn.prod(_tokens([2, 1]), 0), "prod"),
    # a nested ragged axis with a dense one (flatten_levels is given the name)
    "flatten_ragged_and_dense": (lambda: raggedfn.flatten(_sentences(2), 2, 3), "flatten"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_name_the_function_called(case: str) -> None:
    call, name = ERRORS[case]
    with pytest.raises(RaggedError, match=f"^{name}: "):
        call()


def test_masked_select_names_the_sizes_that_differ() -> None:
    x = _tokens([2, 3])
    mask = raggedfn.from_list(
        [torch.ones(3, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool)]
    )
    with pytest.raises(
        RaggedError, match=r"^masked_select: .*: sizes of shape|^masked_select: .*sizes"
    ):
        raggedfn.masked_select(x, mask)


def test_cat_of_nested_values_along_an_inner_axis_says_why_it_refuses() -> None:
    a, b = _sentences(2), _sentences(2, seed=4)
    # the same documents: the tokens of every sentence of a, then of b
    joined = raggedfn.cat([a, b], 2)
    assert joined.row_offsets[0].tolist() == [0, 4, 6, 12]
    other = raggedfn.from_list([[torch.randn(1, 2)], [], [torch.randn(3, 2)]])
    with pytest.raises(
        RaggedError, match=r"^cat: operands have different partitions: sizes .* above axis 2"
    ):
        raggedfn.cat([a, other], 2)


def test_cat_of_nested_batches_checks_every_operands_dense_sizes() -> None:
    a, b = _sentences(2), _sentences(3, seed=4)
    with pytest.raises(RaggedError, match=r"^cat: xs\[1\] has logical shape"):
        raggedfn.cat([a, b], 0)
    with pytest.raises(RaggedError, match=r"^cat: xs\[2\] has logical shape"):
        raggedfn.cat([a, a, b], 0)
    # and equal dense sizes: the samples of both, in order, as a loop over the samples
    c = _sentences(2, seed=5)
    out = raggedfn.cat([a, c], 0)
    assert out.batch_size == a.batch_size + c.batch_size
    raggedfn.check(out)  # raises on a partition that does not hold
    want = [*raggedfn.unbind(a), *raggedfn.unbind(c)]
    got = list(raggedfn.unbind(out))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        if isinstance(w, torch.Tensor):
            assert torch.equal(g, w)
        else:
            assert len(g) == len(w) and all(torch.equal(p, q) for p, q in zip(g, w, strict=True))


def test_values_with_other_partitions_say_that_only_equal_partitions_combine() -> None:
    x = raggedfn.from_list([torch.ones(3, 2), torch.ones(2, 1)], ragged_dims=(1, 2))
    y = raggedfn.from_list([torch.ones(2, 2), torch.ones(3, 1)], ragged_dims=(1, 2))
    with pytest.raises(
        RaggedError,
        match=r"^add: operands have different partitions: sizes .* differ \(only values with "
        r"the same samples and sizes combine elementwise\)$",
    ):
        x + y


def test_logsumexp_over_an_empty_dense_axis_keeps_the_loops_shape():
    """The empty-axis branch of ``_dense_logsumexp`` (torch's own logsumexp, kept dims):
    -inf of the per-sample shape (kills its keepdim=True -> None)."""
    x = raggedfn.from_list([torch.randn(n, 0, 3, dtype=torch.float64) for n in (2, 0, 3)])
    out = raggedfn.logsumexp(x, 2)
    for got, sample in zip(raggedfn.unbind(out), raggedfn.unbind(x), strict=True):
        torch.testing.assert_close(got, torch.logsumexp(sample, 1))


def test_gather_along_the_first_dense_axis_checks_the_later_ones():
    """Along dense axis 0 the index may differ there, but not be larger along the next
    one, as torch.gather (kills `_gather`'s continue -> break)."""
    x = raggedfn.from_list([torch.randn(n, 2, 3, dtype=torch.float64) for n in (2, 3)])
    index = raggedfn.from_list([torch.zeros(n, 1, 4, dtype=torch.int64) for n in (2, 3)])
    for s, i in zip(raggedfn.unbind(x), raggedfn.unbind(index), strict=True):
        with pytest.raises(RuntimeError):
            torch.gather(s, 1, i)
    with pytest.raises(RaggedError, match="size 4 along a dense axis where x has 3"):
        raggedfn.gather(x, 2, index)
    fits = raggedfn.from_list([torch.ones(n, 1, 3, dtype=torch.int64) for n in (2, 3)])
    got = raggedfn.gather(x, 2, fits)
    for g, s, i in zip(
        raggedfn.unbind(got), raggedfn.unbind(x), raggedfn.unbind(fits), strict=True
    ):
        torch.testing.assert_close(g, torch.gather(s, 1, i))


def test_operators_with_a_tensor_first_as_dynamo_passes_them(monkeypatch: Any) -> None:
    """Under ``torch.compile`` dynamo calls ``Ragged.__torch_function__`` with the tensor
    method and the tensor operand first (``ops/_operators.py``); reached eagerly here with
    ``is_compiling()`` patched: ``W @ x`` and ``x @ W`` (both arrive as
    ``Tensor.matmul(W, x)``, told apart by the shapes), ``t - x`` and ``x - t`` give
    torch's answer per sample; a call with other arguments is declined."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 3, generator=gen, dtype=torch.float64) for n in (2, 0, 4)]
    x = raggedfn.from_list(xs)
    right = torch.randn(3, 5, generator=gen, dtype=torch.float64)  # x @ right
    left = torch.randn(4, 3, generator=gen, dtype=torch.float64)  # each sample's left @ x_i.T
    t = torch.randn(3, generator=gen, dtype=torch.float64)
    dispatch = raggedfn.Ragged.__torch_function__
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    T = torch.Tensor
    got = dispatch(T.matmul, (T, raggedfn.Ragged), (right, x))
    for g, s in zip(_samples(got), xs, strict=True):
        torch.testing.assert_close(g, s @ right)
    xt = raggedfn.transpose(x, 1, 2)  # (B, 3, N*)
    got = dispatch(T.matmul, (T, raggedfn.Ragged), (left, xt))
    for g, s in zip(_samples(got), xs, strict=True):
        torch.testing.assert_close(g, left @ s.T)
    got = dispatch(T.sub, (T, raggedfn.Ragged), (t, x))  # t - x
    for g, s in zip(_samples(got), xs, strict=True):
        torch.testing.assert_close(g, t - s)
    got = dispatch(T.__rsub__, (T, raggedfn.Ragged), (t, x))  # x - t
    for g, s in zip(_samples(got), xs, strict=True):
        torch.testing.assert_close(g, s - t)
    square = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    # (B, N*, 3, 3): x @ W and W @ x both fit
    cubes = raggedfn.from_list([torch.randn(n, 3, 3, generator=gen) for n in (2, 1)])
    with pytest.raises(RaggedError, match="unambiguous"):
        dispatch(T.matmul, (T, raggedfn.Ragged), (square.float(), cubes))
    assert dispatch(T.sub, (T, raggedfn.Ragged), (t, x, 1)) is NotImplemented
    assert dispatch(T.sub, (T, raggedfn.Ragged), (t, x), {"alpha": 2}) is NotImplemented
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert dispatch(T.sub, (T, raggedfn.Ragged), (t, x)) is NotImplemented


def test_mark_dynamic_tags_axis_0_of_every_part_of_every_ragged_leaf() -> None:
    """Eagerly, before the compiled call: the packed axis of ``values``, the batch axis of
    ``offsets`` and ``sizes`` and the element axis of every nested level are tagged (kills
    ``maybe_mark_dynamic(leaf.offsets, None)``); a plain tensor leaf is left alone."""
    docs, tokens, plain = _sentences(2), _tokens([2, 1]), torch.zeros(3)
    before = [t.clone() for t in (docs.values, tokens.values)]
    raggedfn.mark_dynamic({"docs": docs, "rest": [tokens, plain]})
    for x in (docs, tokens):
        parts = (x.values, x.offsets, x.sizes, *x.row_offsets)
        assert len(parts) == 3 + len(x.row_offsets)
        for part in parts:
            assert part._dynamo_weak_dynamic_indices == {0}
    assert len(docs.row_offsets) == 1
    assert not hasattr(plain, "_dynamo_weak_dynamic_indices")
    assert torch.equal(docs.values, before[0]) and torch.equal(tokens.values, before[1])


REFLECTED = ("add", "sub", "mul", "truediv", "floordiv", "pow")


@pytest.mark.parametrize("name", REFLECTED)
def test_binary_operators_keep_the_operands_order(name: str) -> None:
    """``x op t`` and ``t op x`` give torch's answer per sample, for the bound dunders and
    for methods built anew by ``_operators._method`` (the dunders are built at import,
    before mutmut picks a mutant: a rebuilt one is what a mutant of ``_method`` changes;
    kills ``op(other, self) if reflected or True``)."""
    import operator

    from raggedfn.ops import _operators

    gen = torch.Generator().manual_seed(5)
    xs = [torch.rand(n, 3, generator=gen, dtype=torch.float64) + 0.5 for n in (2, 0, 3)]
    x = raggedfn.from_list(xs)
    t = torch.rand(3, generator=gen, dtype=torch.float64) * 2 + 0.25
    py = getattr(operator, name)
    op = _operators._BINARY[name]
    forward = _operators._method(f"Ragged.__{name}__", op, reflected=False)
    backward = _operators._method(f"Ragged.__r{name}__", op, reflected=True)
    for got, want in (
        (py(x, t), [py(s, t) for s in xs]),
        (py(t, x), [py(t, s) for s in xs]),
        (forward(x, t), [py(s, t) for s in xs]),
        (backward(x, t), [py(t, s) for s in xs]),
    ):
        samples = _samples(got)
        assert len(samples) == len(want)
        for g, w in zip(samples, want, strict=True):
            torch.testing.assert_close(g, w)
    assert forward.__name__ == f"Ragged.__{name}__" and backward.__name__ == f"Ragged.__r{name}__"


def test_gather_along_a_nested_axis_traced_on_fake_tensors_checks_the_index_in_the_graph():
    """make_fx with fake tensors (as torch.compile and torch.export trace): whether an index
    value names an element of x cannot be read, so it is an assert in the graph; the graph
    gives torch.gather of every sentence of every sample, and refuses a bad index when run.
    Fake tensors outside any fx trace (shape propagation) are recognised by the index
    itself (kills ``is_tracing(None)`` in ``_check_found``, which reads the fake data
    there; under make_fx the fx tracer alone says so)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(0)
    docs = [[torch.randn(n, 2, generator=gen) for n in doc] for doc in ([2, 3], [], [1])]
    picks = [
        [torch.tensor([[1, 0], [0, 0], [1, 1]]), torch.tensor([[2, 1]])],
        [],
        [torch.tensor([[0, 0], [0, 0]])],
    ]
    x, index = raggedfn.from_list(docs), raggedfn.from_list(picks)

    def run(*parts: torch.Tensor) -> torch.Tensor:
        xv, xo, xs, xr, iv, io, isz, ir = parts
        xx = raggedfn.Ragged(xv, xo, xs, x.layout, (xr,))
        ii = raggedfn.Ragged(iv, io, isz, index.layout, (ir,))
        return raggedfn.gather(xx, 2, ii).values

    parts = [x.values, x.offsets, x.sizes, *x.row_offsets]
    parts += [index.values, index.offsets, index.sizes, *index.row_offsets]
    graph = make_fx(run, tracing_mode="fake")(*parts)
    want = [
        torch.gather(sentence, 0, pick)
        for doc, doc_picks in zip(docs, picks, strict=True)
        for sentence, pick in zip(doc, doc_picks, strict=True)
    ]
    assert torch.equal(graph(*parts), torch.cat(want))
    bad = index.values.clone()
    bad[0, 0] = 2  # the first sentence of sample 0 has 2 tokens
    with pytest.raises(RuntimeError, match=r"gather: index values must name an element"):
        graph(*parts[:4], bad, *parts[5:])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = run(*(mode.from_tensor(t) for t in parts))
    assert fake.shape == torch.cat(want).shape
