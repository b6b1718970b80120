"""Boundaries under ``torch.compile(fullgraph=True)``: bad input raises an error naming the
same problem as eager, axes passed as arguments specialize, and operators between a
``Ragged`` value and a tensor compile.

Most cases compile with ``backend="eager"`` (dynamo's checks and the graph's assertions
are what is tested, and it is fast); one device-side assertion also runs under inductor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import raggedfn
from raggedfn import Layout, Ragged, RaggedError

# torch 2.13's dynamo instantiates ``torch.autograd.Function()`` for the ctx of every
# custom Function it traces, which warns; the warning is torch's, not raggedfn's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def tokens(lengths, dim=4, seed=0, dtype=torch.float32) -> Ragged:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), dim, generator=gen).to(dtype)
    return raggedfn.from_lengths(values, torch.tensor(lengths))


def fresh() -> None:
    torch._dynamo.reset()
    counters.clear()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def both_refuse(f: Callable[..., Any], args: tuple[Any, ...], pattern: str, **compile_kw: Any):
    """Eager raises ``RaggedError`` and the compiled call an error, both matching ``pattern``."""
    with pytest.raises(RaggedError, match=pattern):
        f(*args)
    fresh()
    compiled = torch.compile(
        f, fullgraph=True, backend=compile_kw.pop("backend", "eager"), **compile_kw
    )
    with pytest.raises(Exception, match=pattern) as info:
        compiled(*args)
    return info.value


# ----- errors found while tracing (shapes, axes, dtypes) ------------------------------

W34 = torch.ones(3, 4)
TRACE_ERRORS = [
    (
        lambda x: raggedfn.sum(x, 5),
        r"sum: axis 5 is out of range for a sample of rank 2 \(logical shape \(N\*, 4\)\)",
    ),
    (
        lambda x: raggedfn.softmax(x, -4).values,
        r"softmax: axis -4 is out of range for a sample of rank 2 \(logical shape \(N\*, 4\)\)",
    ),
    (
        lambda x: raggedfn.transpose(x, 1, 3).values,
        r"transpose: axis 3 is out of range for a sample of rank 2",
    ),
    (
        lambda x: raggedfn.matmul(x, W34).values,
        r"matmul: expected b to have the inner size 4 of a along axis 0, got a of logical "
        r"shape \(B=2, N\*, 4\) and b of shape \(3, 4\)",
    ),
    (
        lambda x: (x @ W34).values,
        r"matmul: expected b to have the inner size 4 of a along axis 0",
    ),
    (
        lambda x: raggedfn.amax(x.with_values(x.values.to(torch.complex64)), 1),
        r"amax: expected a real dtype \(complex numbers have no order\), got values of "
        r"torch.complex64",
    ),
    (
        lambda x: x.with_values(x.values[1:]).values,
        r"with_values: values must have 7 packed rows, got shape \(6, 4\)",
    ),
    (
        lambda x: Ragged(x.values, x.offsets, x.sizes[:1], x.layout).values,
        r"Ragged: expected sizes of shape \[B, R\] with B = len\(offsets\) - 1 = 2, got sizes "
        r"of shape \(1, 1\)",
    ),
    (
        lambda x: raggedfn.linear(x, torch.ones(2, 3)).values,
        r"linear: weight must have shape \(2, 4\)",
    ),
    (
        lambda x: raggedfn.from_sizes(x.values, torch.tensor([3, 4])).values,
        r"from_sizes: expected sizes of shape \[B, R\]",
    ),
    (
        lambda x: raggedfn.add(x, raggedfn.unsqueeze(x, 1)).values,
        r"add: operand 1 has logical shape \(2, 1, None, 4\) but operand 0 has \(2, None, 4\)",
    ),
]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("f", "pattern"), TRACE_ERRORS)
def test_trace_time_errors_name_the_problem(f, pattern, dynamic):
    both_refuse(f, (tokens([3, 4]),), pattern, dynamic=dynamic)


def test_different_row_counts_are_refused_while_tracing():
    x, y = tokens([3, 4]), tokens([3, 5], seed=1)
    for dynamic in (False, True):
        both_refuse(
            lambda a, b: (a + b).values,
            (x, y),
            r"add: operands have different partitions",
            dynamic=dynamic,
        )


# ----- errors found when the graph runs (the data) -------------------------------------


def _compiled_then_bad(f, good, bad, pattern, backend="eager"):
    """Compile on ``good`` inputs (dynamic shapes), then call with ``bad``: the graph's own
    assertion raises, with the eager message's words."""
    with pytest.raises(RaggedError, match=pattern):
        f(*bad)
    fresh()
    compiled = torch.compile(f, fullgraph=True, backend=backend, dynamic=True)
    compiled(*good)
    with pytest.raises(RuntimeError, match=pattern):
        compiled(*bad)
    assert graphs() == 1  # the same graph refused the bad data: no recompile, no eager fallback


def test_mismatched_partitions_with_equal_row_counts():
    _compiled_then_bad(
        lambda a, b: (a + b).values,
        (tokens([3, 4, 2]), tokens([3, 4, 2], seed=1)),
        (tokens([3, 4, 2]), tokens([4, 3, 2], seed=1)),
        r"add: operands have different partitions",
    )


def _gather_args(bad: bool) -> tuple[Ragged, Ragged]:
    x = tokens([3, 4, 2], dim=2)
    index = torch.zeros(5, 2, dtype=torch.int64)
    index[4, 0] = 2 if bad else 1  # sample 2 (row 4 of the index) has 2 elements
    return x, raggedfn.from_lengths(index, [1, 3, 1])


def _gather(x, index):
    return raggedfn.gather(x, 1, index).values


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_gather_out_of_range_is_a_device_side_assertion(backend):
    pattern = (
        re.escape("gather: ")
        + r".*"
        + re.escape("index values must lie in [0, size of axis 1) of each sample")
    )
    _compiled_then_bad(_gather, _gather_args(False), _gather_args(True), pattern, backend)


def _from_lengths(values, lengths):
    return raggedfn.from_lengths(values, lengths).offsets


def _from_offsets(values, offsets):
    return raggedfn.sum(raggedfn.from_offsets(values, offsets), 1)


def _check(values, offsets):
    layout = Layout.standard(1, 1)
    sizes = (offsets[1:] - offsets[:-1]).unsqueeze(1)
    return raggedfn.check(Ragged(values, offsets.clone().add_(0), sizes, layout)).offsets


VALUES = torch.ones(7, 2)
DATA_ERRORS = [
    (
        _from_lengths,
        (VALUES, torch.tensor([3, 4])),
        (VALUES, torch.tensor([3, 5])),
        r"from_lengths: lengths (must )?account for .*packed rows in total",
    ),
    (
        _from_lengths,
        (VALUES, torch.tensor([3, 4])),
        (VALUES, torch.tensor([9, -2])),
        r"from_lengths: lengths must be non-negative",
    ),
    (
        _from_offsets,
        (VALUES, torch.tensor([0, 3, 7])),
        (VALUES, torch.tensor([0, 5, 3, 7])),
        r"from_offsets: offsets must never decrease",
    ),
    (
        _check,
        (VALUES, torch.tensor([0, 3, 7])),
        (VALUES, torch.tensor([0, 3, 6])),
        r"check: offsets must end at values.shape\[0\]",
    ),
]


@pytest.mark.parametrize(("f", "good", "bad", "pattern"), DATA_ERRORS)
def test_constructor_checks_compile_to_assertions(f, good, bad, pattern):
    _compiled_then_bad(f, good, bad, pattern)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(*good), f(*good))


# ----- axes passed as arguments are static ------------------------------------------------


def _packed(out: Ragged | torch.Tensor) -> torch.Tensor:
    return out.values if isinstance(out, Ragged) else out


AXIS_OPS = {
    "sum": lambda x, a: _packed(raggedfn.sum(x, a)),
    "softmax": lambda x, a: raggedfn.softmax(x, a).values,
    "cumsum": lambda x, a: raggedfn.cumsum(x, a).values,
    "transpose": lambda x, a: raggedfn.contiguous(raggedfn.transpose(x, a, -1)).values,
    "amax": lambda x, a: _packed(raggedfn.amax(x, (a,))),
    "argmax": lambda x, a: _packed(raggedfn.argmax(x, a)),
}


@pytest.mark.parametrize("name", sorted(AXIS_OPS))
def test_axis_arguments_specialize_under_dynamic_true(name):
    f = AXIS_OPS[name]
    fresh()
    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=True)
    for lengths in ([3, 4], [2, 5, 6]):
        x = tokens(lengths)
        torch.testing.assert_close(compiled(x, 1), f(x, 1))
    assert graphs() == 1  # new lengths, same axis: the same graph
    for lengths in ([2, 5, 6], [4, 1]):
        x = tokens(lengths)
        torch.testing.assert_close(compiled(x, 2), f(x, 2))
    assert graphs() == 2  # another axis is another graph, then reused
    torch.testing.assert_close(compiled(x, -1), f(x, -1))
    assert graphs() == 3  # the axis argument is guarded as given (-1 is not 2)


def test_a_bad_axis_argument_is_refused_with_its_message():
    both_refuse(
        lambda x, a: raggedfn.sum(x, a),
        (tokens([3, 4]), 7),
        r"sum: axis 7 is out of range",
        dynamic=True,
    )


# ----- operators between Ragged values and tensors ------------------------------------------

T4 = torch.rand(4) + 0.5
OPERATORS = {
    "x + t": lambda x, t: x + t,
    "t + x": lambda x, t: t + x,
    "x - t": lambda x, t: x - t,
    "t - x": lambda x, t: t - x,
    "x * t": lambda x, t: x * t,
    "t * x": lambda x, t: t * x,
    "x / t": lambda x, t: x / t,
    "t / x": lambda x, t: t / x,
    "x // t": lambda x, t: x // t,
    "t // x": lambda x, t: t // x,
    "x ** t": lambda x, t: abs(x) ** t,
    "t ** x": lambda x, t: t**x,
    "x < t": lambda x, t: x < t,
    "t < x": lambda x, t: t < x,
    "x >= t": lambda x, t: x >= t,
    "t <= x": lambda x, t: t <= x,
    "x == t": lambda x, t: x == t,
    "t != x": lambda x, t: t != x,
    "x @ W": lambda x, t: x @ t[:, None].expand(4, 3),
    "W @ x": lambda x, t: t[:, None].expand(4, 3).T @ raggedfn.transpose(x, 1, 2),
    "(x * t) @ W + t": lambda x, t: (x * t) @ t[:, None].expand(4, 4) + t,
    "x -= t": lambda x, t: _isub(x, t),
}


def _isub(x, t):
    x -= t
    return x


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_operators_with_a_tensor_compile_to_one_graph(name):
    f = OPERATORS[name]
    x = tokens([3, 4])
    want = f(x, T4)
    fresh()
    got = torch.compile(f, fullgraph=True, backend="eager")(x, T4)
    assert isinstance(got, Ragged) and got.layout == want.layout
    torch.testing.assert_close(got.values, want.values)
    assert torch.equal(got.offsets, want.offsets)
    assert graphs() == 1


def test_compiled_matmul_refuses_to_guess_when_both_orders_fit():
    """Dynamo passes ``x @ W`` and ``W @ x`` the same way; where both fit, refuse."""
    x = raggedfn.from_lengths(torch.randn(7, 4, 4), [3, 4])  # (B, N*, 4, 4)
    weight = torch.randn(4, 4)
    fresh()
    compiled = torch.compile(lambda a, w: (a @ w).values, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"matmul: expected x @ W or W @ x to be unambiguous"):
        compiled(x, weight)
    compiled = torch.compile(
        lambda a, w: raggedfn.matmul(a, w).values, fullgraph=True, backend="eager"
    )
    torch.testing.assert_close(compiled(x, weight), (x @ weight).values)


def test_torch_functions_still_refuse_ragged_values():
    x = tokens([3, 4])
    with pytest.raises(TypeError):
        torch.sum(x)  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        torch.nn.functional.relu(x)  # type: ignore[arg-type]


MORE_TRACE_ERRORS = [
    (
        lambda x: raggedfn.cat([x, raggedfn.transpose(x, 1, 2)], 1).values,
        r"cat: xs\[1\] has layout Layout\('d0 r0'\), expected Layout\('r0 d0'\) like xs\[0\]",
    ),
    (
        lambda x: raggedfn.einsum("bnd,bmd->bnx", x, x),
        r"einsum: equation 'bnd,bmd->bnx': expected every output subscript in an operand, got "
        r"\['x'\] only in the output",
    ),
    (
        lambda x: raggedfn.layer_norm(x, 5).values,
        r"layer_norm: normalized_shape \(5,\) must equal the trailing axes of logical shape "
        r"\(N\*, 4\)",
    ),
    (lambda x: raggedfn.unsqueeze(x, 7).values, r"unsqueeze: dim 7 is out of range"),
    (lambda x: x[0, 1], r"Ragged.__getitem__: multi-axis indexing \(0, 1\) is not supported"),
]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("f", "pattern"), MORE_TRACE_ERRORS)
def test_more_trace_time_errors_name_the_problem(f, pattern, dynamic):
    both_refuse(f, (tokens([3, 4]),), pattern, dynamic=dynamic)


def test_cat_along_a_dense_axis_checks_partitions_in_the_graph():
    def f(a, b):
        return raggedfn.cat([a, b], 2).values

    _compiled_then_bad(
        f,
        (tokens([3, 4, 2]), tokens([3, 4, 2], seed=1)),
        (tokens([3, 4, 2]), tokens([4, 3, 2], seed=1)),
        r"cat: operands have different partitions",
    )
