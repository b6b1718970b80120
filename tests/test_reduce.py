"""Public reductions, softmax and cumsum: errors, result structure, torch.func, compile.

Equality with the per-sample loop is in property_tests/test_reduce_props.py and
property_tests/test_softmax_props.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.func import grad, jacrev, vmap

import raggedfn
from raggedfn import Layout, Ragged, RaggedError
from raggedfn._layout import Axis


def tokens(lengths: list[int], dim: int = 3, seed: int = 0) -> Ragged:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), dim, generator=gen, dtype=torch.float64)
    return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def pairs(sizes: list[list[int]], seed: int = 0) -> Ragged:
    gen = torch.Generator().manual_seed(seed)
    total = sum(a * b for a, b in sizes)
    values = torch.randn(total, 2, generator=gen, dtype=torch.float64)
    return raggedfn.from_sizes(values, torch.tensor(sizes))


# ----- errors -------------------------------------------------------------------
X = tokens([2, 0, 3])

ERRORS = [
    (lambda: raggedfn.sum(X, 3), r"^sum: axis 3 is out of range for a sample of rank 2 \(logical shape \(N\*, 3\)\)"),
    (lambda: raggedfn.mean(X, -4), r"^mean: axis -4 is out of range for a sample of rank 2"),
    (lambda: raggedfn.sum(X, 0), r"^sum: dim=0 includes axis 0, the batch axis, which can only be reduced together with every other axis \(dim=None\); logical shape \(B, N\*, 3\)"),
    (lambda: raggedfn.amax(X, (0, 1)), r"^amax: dim=\(0, 1\) includes axis 0, the batch axis"),
    (lambda: raggedfn.sum(X, (1, -2)), r"^sum: axes \(1, -2\) repeat an axis"),
    (lambda: raggedfn.sum(X, 1.5), r"^sum: axis must be an int, got float 1.5"),
    (lambda: raggedfn.sum(X.values, 1), r"^sum: x must be a Ragged value, got a torch.float64 tensor of shape \(5, 3\)"),
    (lambda: raggedfn.argmax(X), r"^argmax: dim=None \(a flat index into the whole batch\) is not supported; pass one logical axis"),
    (lambda: raggedfn.argmin(X, 0), r"^argmin: axis 0 is the batch axis and cannot be used here"),
    (lambda: raggedfn.mean(X.to(torch.int64), 1), r"^mean: x must have a floating point or complex dtype, got torch.int64"),
    (lambda: raggedfn.var(X.to(torch.int64), 1), r"^var: x must have a floating point or complex dtype, got torch.int64"),
    (lambda: raggedfn.norm(X, "nuc", 1), r"^norm: p must be a number, inf, -inf or 'fro', got 'nuc'"),
    (lambda: raggedfn.softmax(X, 0), r"^softmax: axis 0 is the batch axis and cannot be used here"),
    (lambda: raggedfn.log_softmax(X, 3), r"^log_softmax: axis 3 is out of range for a sample of rank 2"),
    (lambda: raggedfn.softmax(X.to(torch.int64), 1), r"^softmax: x must have a floating point dtype \(or pass dtype=\), got torch.int64"),
    (lambda: raggedfn.softmax([1.0], 1), r"^softmax: x must be a Ragged value, got list \[1.0\]"),
    (lambda: raggedfn.cumsum(X, 0), r"^cumsum: axis 0 is the batch axis and cannot be used here"),
    (lambda: raggedfn.cumsum(X, 2.0), r"^cumsum: axis must be an int, got float 2.0"),
]  # fmt: skip


@pytest.mark.parametrize("call, message", ERRORS)
def test_bad_input_raises_ragged_error(call: object, message: str) -> None:
    with pytest.raises(RaggedError, match=message):
        call()  # type: ignore[operator]


# ----- result structure ---------------------------------------------------------
def test_removing_the_last_ragged_axis_gives_a_dense_tensor() -> None:
    out = raggedfn.sum(X, 1)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 3)
    kept = raggedfn.sum(X, 1, keepdim=True)
    assert isinstance(kept, torch.Tensor) and kept.shape == (3, 1, 3)
    assert raggedfn.sum(X, (1, 2)).shape == (3,)
    assert raggedfn.sum(X).shape == () and raggedfn.sum(X, keepdim=True).shape == (1, 1, 1)


def test_dense_reduction_keeps_the_partition() -> None:
    out = raggedfn.amax(X, 2)
    assert isinstance(out, Ragged) and out.offsets is X.offsets and out.shape == (3, None)
    kept = raggedfn.amax(X, -1, keepdim=True)
    assert isinstance(kept, Ragged) and kept.shape == (3, None, 1)


def test_reducing_one_of_two_ragged_axes() -> None:
    x = pairs([[2, 3], [0, 4], [3, 1]])
    rows = raggedfn.sum(x, 1)
    assert isinstance(rows, Ragged) and rows.shape == (3, None, 2)
    assert rows.lengths.tolist() == [3, 4, 1]
    cols = raggedfn.mean(x, 2, keepdim=True)
    assert isinstance(cols, Ragged) and cols.shape == (3, None, 1, 2)
    assert cols.lengths.tolist() == [2, 0, 3]
    # The reduced ragged axis becomes a dense axis of size 1 at its position.
    assert cols.layout == Layout((Axis(True, 0), Axis(False, 1), Axis(False, 0)))
    assert raggedfn.argmax(x, 2).values.dtype == torch.int64


def test_argmax_positions_and_empty_samples() -> None:
    x = raggedfn.from_list([torch.tensor([1.0, 5.0, 5.0]), torch.tensor([]), torch.tensor([2.0])])
    assert raggedfn.argmax(x, 1).tolist() == [1, -1, 0]
    assert raggedfn.argmin(x, -1, keepdim=True).tolist() == [[0], [-1], [0]]


def test_integer_extrema_identity() -> None:
    x = raggedfn.from_list(
        [torch.tensor([3, 1], dtype=torch.int32), torch.tensor([], dtype=torch.int32)]
    )
    assert raggedfn.amax(x, 1).tolist() == [3, torch.iinfo(torch.int32).min]
    assert raggedfn.amin(x, 1).tolist() == [1, torch.iinfo(torch.int32).max]
    assert raggedfn.sum(x, 1).dtype == torch.int64


def test_empty_batch() -> None:
    x = tokens([])
    assert raggedfn.sum(x, 1).shape == (0, 3)
    assert raggedfn.amax(x).item() == float("-inf")
    assert raggedfn.softmax(x, 1).values.shape == (0, 3)


# ----- torch.func over the public ops -------------------------------------------
OPS = {
    "sum": lambda x: raggedfn.sum(x, 1),
    "mean": lambda x: raggedfn.mean(x, (1, 2)),
    "amax": lambda x: raggedfn.amax(x, 1),
    "logsumexp": lambda x: raggedfn.logsumexp(x, 1),
    "prod": lambda x: raggedfn.prod(x, 1),
    "var": lambda x: raggedfn.var(x, 1),
    "norm": lambda x: raggedfn.norm(x, 2, 1),
    "softmax": lambda x: raggedfn.softmax(x, 1).values,
    "log_softmax": lambda x: raggedfn.log_softmax(x, 1).values,
    "cumsum": lambda x: raggedfn.cumsum(x, 1).values,
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_func_transforms_over_public_ops(name: str) -> None:
    x = tokens([2, 3, 1])
    op = OPS[name]

    def loss(values: torch.Tensor) -> torch.Tensor:
        return op(x.with_values(values)).sin().sum()

    values = x.values.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(loss(values), values)
    torch.testing.assert_close(grad(loss)(x.values), want)
    jac = jacrev(lambda v: op(x.with_values(v)))(x.values)
    torch.testing.assert_close(
        jac, torch.autograd.functional.jacobian(lambda v: op(x.with_values(v)), x.values)
    )
    # Per-example gradients: vmap over an extra leading axis of values.
    stacked = torch.stack([x.values, 2 * x.values, -x.values])
    per_example = vmap(grad(loss))(stacked)
    torch.testing.assert_close(per_example, torch.stack([grad(loss)(v) for v in stacked]))


# ----- compile -----------------------------------------------------------------
def _chain(x: Ragged, weight: torch.Tensor) -> torch.Tensor:
    scores = raggedfn.softmax(x.with_values(x.values @ weight), 1)
    pooled = raggedfn.sum(x.with_values(scores.values * x.values), 1)
    return pooled.pow(2).sum() + raggedfn.amax(x, 1).sum() + raggedfn.logsumexp(x, (1, 2)).sum()


# torch 2.13's dynamo builds an autograd ctx inside catch_warnings(record=True) without
# "always", so under warnings-as-errors its own DeprecationWarning escapes.
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_compiled_chain_matches_eager_without_recompiling() -> None:
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_chain, fullgraph=True, dynamic=True, backend="aot_eager")
    weight = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for seed, lengths in enumerate([[3, 5], [4, 2, 7], [6, 6, 1, 2], [2, 9, 3]]):
        x = tokens(lengths, seed=seed)
        values = x.values.requires_grad_(True)
        got = compiled(x, weight)
        (got_grad,) = torch.autograd.grad(got, values)
        want = _chain(x, weight)
        (want_grad,) = torch.autograd.grad(want, values)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    assert counters["stats"]["unique_graphs"] <= 2


PAIR_OPS = {
    "sum_rows": lambda x: raggedfn.sum(x, 1).values,
    "amax_cols": lambda x: raggedfn.amax(x, 2).values,
    "cumsum_outer": lambda x: raggedfn.cumsum(x, 1).values,
    "softmax_outer": lambda x: raggedfn.softmax(x, 1).values,
    "var_both": lambda x: raggedfn.var(x, (1, 2)),
    "prod_rows": lambda x: raggedfn.prod(x, 1).values,
    "logsumexp_cols": lambda x: raggedfn.logsumexp(x, 2).values,
}


@pytest.mark.parametrize("name", sorted(PAIR_OPS))
def test_per_example_grads_over_two_ragged_axes(name: str) -> None:
    x = pairs([[2, 3], [4, 1], [0, 5]])
    op = PAIR_OPS[name]

    def loss(values: torch.Tensor) -> torch.Tensor:
        return op(x.with_values(values)).sin().sum()

    stacked = torch.stack([x.values, 2 * x.values])
    per_example = vmap(grad(loss))(stacked)
    assert per_example.isfinite().all()
    torch.testing.assert_close(per_example, torch.stack([grad(loss)(v) for v in stacked]))


def test_logsumexp_over_ragged_and_dense_axes_with_an_all_minus_inf_row_has_torchs_gradient():
    """A dense row that is -inf throughout, reduced with finite rows of its sample: torch's
    gradient is finite (0 there); a dense torch.logsumexp step first gave NaN."""
    inf = float("-inf")
    sample = torch.tensor(
        [[inf, 0.25, 0.5], [inf, inf, inf], [-1.5, 0.5, -1.0]], dtype=torch.float64
    )
    values = sample.clone().requires_grad_(True)
    out = raggedfn.logsumexp(raggedfn.from_list([values]), (1, 2))
    (got,) = torch.autograd.grad(out.sum(), values)
    leaf = sample.clone().requires_grad_(True)
    want = torch.logsumexp(leaf, (0, 1))
    torch.testing.assert_close(out, want.reshape(1))
    torch.testing.assert_close(got, torch.autograd.grad(want, leaf)[0])


def test_std_of_all_equal_values_has_gradient_zero_as_torch():
    """Zero variance: torch.std's gradient is 0 (its rule masks it); sqrt alone gave NaN."""
    values = torch.full((4, 2), 1.5, dtype=torch.float64, requires_grad=True)
    x = raggedfn.from_lengths(values, [3, 1])
    (got,) = torch.autograd.grad(raggedfn.std(x, 1, correction=0).sum(), values)
    leaf = values.detach().clone().requires_grad_(True)
    want = torch.std(leaf[:3], 0, correction=0).sum() + torch.std(leaf[3:], 0, correction=0).sum()
    torch.testing.assert_close(got, torch.autograd.grad(want, leaf)[0])
    assert torch.equal(got, torch.zeros_like(got))


def test_float32_var_and_std_of_subnormal_values_accumulate_like_torch():
    """torch's CPU var/std accumulate float32 in float64: squares of 4e-39 do not vanish."""
    sample = torch.tensor([4.4e-39, -4.4e-39, 0.0], dtype=torch.float32)
    values = sample.clone().requires_grad_(True)
    x = raggedfn.from_list([values])
    leaf = sample.clone().requires_grad_(True)
    for op in (raggedfn.std, raggedfn.var):
        out = op(x, 1)
        want = getattr(torch, op.__name__)(leaf, 0)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, want.reshape(1), rtol=1e-6, atol=0.0)
    assert float(raggedfn.std(x, 1).detach()[0]) > 0  # var itself underflows, as torch's
    (got,) = torch.autograd.grad(raggedfn.std(x, 1).sum(), values)
    torch.testing.assert_close(got, torch.autograd.grad(torch.std(leaf, 0), leaf)[0])


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    "make, dim",
    [
        (lambda: raggedfn.from_lengths(torch.randn(9, 3, 2, dtype=torch.float64), [4, 0, 5]), 1),
        (lambda: raggedfn.from_lengths(torch.randn(9, dtype=torch.float64), [4, 0, 5]), -1),
        (lambda: raggedfn.from_lengths(torch.randn(9, 4, dtype=torch.float64), [4, 0, 5]), -2),
        (lambda: raggedfn.from_lengths(torch.randn(0, 4, dtype=torch.float64), []), 1),
    ],
)
def test_sum_over_the_samples_with_and_without_its_shortcut(make, dim, fast, monkeypatch):
    from raggedfn.ops import _reduce

    if not fast:
        monkeypatch.setattr(_reduce, "whole_samples", lambda *_: False)
    x = make()
    assert _reduce.whole_samples(x, dim, False) == fast
    values = x.values.clone().requires_grad_(True)
    got = raggedfn.sum(x.with_values(values), dim)
    lengths = x.lengths.tolist()
    parts = [part.sum(0) for part in values.split(lengths)]
    want = torch.stack(parts) if parts else values.new_zeros((0, *values.shape[1:]))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    if values.numel():
        cotangent = torch.randn_like(got)
        torch.testing.assert_close(
            torch.autograd.grad(got, values, cotangent)[0],
            torch.autograd.grad(want, values, cotangent)[0],
        )


@pytest.mark.parametrize(
    "x, dim, keepdim",
    [
        (tokens([2, 3]), 1, True),  # keeps an axis
        (tokens([2, 3]), 2, False),  # a dense axis
        (pairs([[2, 3], [1, 1]]), 1, False),  # one of two ragged axes
        (raggedfn.transpose(tokens([2, 3]), 1, 2), 2, False),  # the ragged axis not first
        (tokens([2, 3]), (1,), False),  # not a plain int
    ],
)
def test_sum_shortcut_refuses_other_reductions(x, dim, keepdim):
    from raggedfn.ops import _reduce

    assert not _reduce.whole_samples(x, dim, keepdim)
    got = raggedfn.sum(x, dim, keepdim=keepdim)
    axis = dim - 1 if isinstance(dim, int) else 0
    want = [sample.sum(axis, keepdim=keepdim) for sample in raggedfn.unbind(x)]
    got = raggedfn.unbind(got) if isinstance(got, Ragged) else list(got)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
