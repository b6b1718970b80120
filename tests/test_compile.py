"""torch.compile of a chain of raggedfn ops: equal to eager, no graph break, few graphs.

The chain: embed -> layer_norm -> linear -> softmax over the ragged axis ->
weighted sum over the ragged axis -> loss, forward and backward. Compiling is
slow on this CPU, so one compiled function is shared by the tests of this file.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import raggedfn

VOCAB, DIM = 11, 5  # distinct from every T and B + 1 below: no duck-sized coincidences

# torch 2.13's dynamo instantiates ``torch.autograd.Function()`` for the ctx of every
# custom Function it traces, which warns; the warning is torch's, not raggedfn's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def param(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    return {
        "table": param(VOCAB, DIM),
        "norm_weight": param(DIM),
        "norm_bias": param(DIM),
        "score_weight": param(1, DIM),
        "score_bias": param(1),
    }


def pooled_loss(ids: raggedfn.Ragged, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = raggedfn.apply(F.embedding, ids, p["table"])  # (B, N*, D)
    h = raggedfn.layer_norm(h, DIM, p["norm_weight"], p["norm_bias"])
    scores = raggedfn.linear(h, p["score_weight"], p["score_bias"])  # (B, N*, 1)
    weights = raggedfn.softmax(scores, 1)
    pooled = raggedfn.sum(weights * h, 1)  # dense [B, D]
    return (pooled**2).sum() + pooled.sum()


def batch(lengths: list[int], seed: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    return raggedfn.from_lengths(ids, lengths)


LENGTHS = [
    [3, 5],
    [2, 7, 4],
    [6, 1, 3, 2],
    [9, 9],
    [1, 2, 3, 4, 5],
    [4, 4, 4],
    [12, 3],
    [2, 2, 2, 2, 2, 2],
    [7, 1],
    [5, 6, 7],
]


def run_batches(compiled, params, count=10, mark=False):
    """Call ``compiled`` on ``count`` batches (forward and backward); results per batch."""
    runs = []
    for i, lengths in enumerate(LENGTHS[:count]):
        ids = batch(lengths, seed=i)
        if mark:
            raggedfn.mark_dynamic(ids)
        loss = compiled(ids, params)
        grads = torch.autograd.grad(loss, list(params.values()))
        runs.append((ids, loss.detach(), [g.detach() for g in grads]))
    return runs


def fresh_counters() -> None:
    torch._dynamo.reset()
    counters.clear()


def graph_count() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.fixture(scope="module")
def compiled_runs():
    """The chain compiled with ``dynamic=True`` (inductor) over 10 batches, run once."""
    fresh_counters()
    compiled = torch.compile(pooled_loss, fullgraph=True, dynamic=True)
    params = make_params()
    runs = run_batches(compiled, params)
    return params, runs, *graph_count()


def test_compiled_chain_equals_eager(compiled_runs) -> None:
    params, runs, _, _ = compiled_runs
    for ids, loss, grads in runs:
        expected = pooled_loss(ids, params)
        expected_grads = torch.autograd.grad(expected, list(params.values()))
        torch.testing.assert_close(loss, expected.detach())
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e)


def test_compiled_chain_equals_per_sample_loop(compiled_runs) -> None:
    """Independent of raggedfn: the same model written per sample with torch."""
    params, runs, _, _ = compiled_runs
    ids, loss, grads = runs[1]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(ids.batch_size):
        sample = ids.values[int(ids.offsets[i]) : int(ids.offsets[i + 1])]
        h = F.embedding(sample, params["table"])
        h = F.layer_norm(h, (DIM,), params["norm_weight"], params["norm_bias"])
        weights = torch.softmax(F.linear(h, params["score_weight"], params["score_bias"]), 0)
        pooled = (weights * h).sum(0)
        total = total + (pooled**2).sum() + pooled.sum()
    torch.testing.assert_close(loss, total.detach())
    expected_grads = torch.autograd.grad(total, list(params.values()))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_no_graph_break_and_at_most_two_graphs(compiled_runs) -> None:
    _, _, graphs, breaks = compiled_runs
    assert breaks == 0
    assert 1 <= graphs <= 2, f"{graphs} graphs for 10 batches of different lengths"


def test_mark_dynamic_gives_one_graph_without_config() -> None:
    """The default ``dynamic=None`` plus ``raggedfn.mark_dynamic`` on each input."""
    fresh_counters()
    compiled = torch.compile(pooled_loss, fullgraph=True, backend="aot_eager")
    params = make_params(1)
    for ids, loss, grads in run_batches(compiled, params, mark=True):
        expected = pooled_loss(ids, params)
        torch.testing.assert_close(loss, expected.detach())
        expected_grads = torch.autograd.grad(expected, list(params.values()))
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e)
    assert graph_count() == (1, 0)


def test_partitions_are_checked_inside_compiled_code() -> None:
    """Equal-valued partitions from different objects pass; different ones raise at run time."""
    fresh_counters()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def combine(x, y):
        # layout-changing ops compile; Ragged-with-Tensor arithmetic needs the function
        # form under dynamo (``x * t`` is traced as a tensor op, see docs/compile.md)
        scale = y.values.sum()
        return raggedfn.mul(raggedfn.transpose(raggedfn.unsqueeze(x, 2), 2, 3), scale).values

    x = raggedfn.from_lengths(torch.randn(5, 3), [2, 3])
    raggedfn.mark_dynamic(x)
    torch.testing.assert_close(combine(x, x), combine.__wrapped__(x, x))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def add(x, y):
        return (x + y).values

    same = raggedfn.from_lengths(torch.ones(5, 3), [2, 3])
    torch.testing.assert_close(add(x, same), x.values + 1)
    other = raggedfn.from_lengths(torch.ones(5, 3), [3, 2])
    with pytest.raises(RuntimeError, match=r"add: operands have different partitions"):
        add(x, other)
    assert graph_count()[1] == 0


def test_layout_changing_ops_compile_with_dynamic_true() -> None:
    """Ops that build new layouts trace with ``dynamic=True``: the layout stays static."""
    fresh_counters()

    def pair_sum(x):
        pair = raggedfn.unsqueeze(x, 2) * raggedfn.unsqueeze(x, 1)
        pair = raggedfn.contiguous(raggedfn.transpose(pair, 1, 2))
        pair = raggedfn.flatten(raggedfn.unsqueeze(pair, -1), 3, 4)
        return raggedfn.sum(raggedfn.layer_norm(pair, DIM), (1, 2))

    compiled = torch.compile(pair_sum, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, lengths in enumerate(LENGTHS[:4]):
        x = raggedfn.from_lengths(torch.randn(sum(lengths), DIM, dtype=torch.float64), lengths)
        torch.testing.assert_close(compiled(x), pair_sum(x), msg=f"batch {i}")
    assert graph_count() == (1, 0)


def test_pair_state_nn_ops_compile_with_dynamic_true() -> None:
    """``layer_norm``/``linear``/``apply`` on pair states (two ragged axes), ``dynamic=True``.

    Regression: dynamo made the layout's axis numbers symbolic, the ragged axes
    were taken for dense ones and ``reorder_dense`` built an invalid ``permute``.
    """
    fresh_counters()
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(DIM + 1, DIM, generator=gen, dtype=torch.float64)

    def pair_ops(x):
        h = raggedfn.layer_norm(x, DIM)
        h = raggedfn.apply(torch.tanh, raggedfn.linear(h, weight))
        return h.values

    compiled = torch.compile(pair_ops, fullgraph=True, dynamic=True, backend="eager")
    # the first batch has no duck-sized coincidence (B = 3, R = 2, T = 69, dims 5 and 6)
    for i, lengths in enumerate(([2, 7, 4], [3, 6], [6, 3, 3, 2])):
        samples = [torch.randn(n, n, DIM, generator=gen, dtype=torch.float64) for n in lengths]
        x = raggedfn.from_list(samples, ragged_dims=(1, 2))
        torch.testing.assert_close(compiled(x), pair_ops(x), msg=f"batch {i}")
    assert graph_count() == (1, 0)


def _mixed_functions(x, weight, scale):
    return raggedfn.add(raggedfn.matmul(raggedfn.mul(x, scale), weight), scale[:3]).values


def _mixed_operators(x, weight, scale):
    return ((x * scale) @ weight + scale[:3]).values


def _mixed_inputs() -> tuple[raggedfn.Ragged, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    x = raggedfn.from_lengths(torch.randn(7, DIM, generator=gen), [3, 4])
    return x, torch.randn(DIM, 3, generator=gen), torch.randn(DIM, generator=gen)


def test_ragged_tensor_arithmetic_compiles_in_function_form() -> None:
    """``raggedfn.matmul/mul/add`` with dense tensors: one graph, equal to the eager dunders."""
    fresh_counters()
    x, weight, scale = _mixed_inputs()
    compiled = torch.compile(_mixed_functions, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, weight, scale), _mixed_operators(x, weight, scale))
    assert graph_count() == (1, 0)


def test_ragged_tensor_operators_compile() -> None:
    """``(x * t) @ W + t`` with dense tensors: one graph, equal to eager (docs/compile.md:
    dynamo routes these operators through ``Ragged.__torch_function__``)."""
    fresh_counters()
    x, weight, scale = _mixed_inputs()
    compiled = torch.compile(_mixed_operators, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, weight, scale), _mixed_operators(x, weight, scale))
    assert graph_count() == (1, 0)
