"""``raggedfn.map`` over a nested value inside ``torch.compile(fullgraph=True,
dynamic=True)``: the per-document encoder of ``tests/test_map_nested_batched.py``
(raggedfn ops on the document, plain torch on its sentence vectors) equals the eager
nested map and the per-document loop in values and gradients (``torch.func.grad``
inside the compiled step, and ``.backward`` of a compiled loss); batches with new
lengths and batch sizes reuse the graph; the tensors ``f`` captures are the region's
own (a changed weight is read afresh, never a constant of the record); and what only
the per-sample loop can run raises a ``RaggedError`` naming the reason under
``fullgraph=True`` (and runs outside the graph without it).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import raggedfn
from tests.test_map_nested_batched import (
    FALLBACKS,
    D,
    Params,
    _assert_samples,
    _documents,
    _Encoder,
    _loop,
    _loss,
    _params,
    _stack,
    encode,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

# the first batch sets the graph, so no size there is 0 or 1 or equals another (B = 5,
# S = 10 sentences, T = 32 tokens, D = 4); later ones: an empty document, an empty
# sentence, other batch sizes
DOCS = [
    [[3, 2, 4], [2, 5], [3], [6, 2], [2, 3]],
    [[2, 6], [4, 2, 3, 2], [], [5]],
    [[7], [2, 2], [3, 0, 4]],
    [[1, 1, 1], [9, 2], [2], [3, 3], [4], [2, 5, 2]],
]


def fresh() -> None:
    torch._dynamo.reset()
    counters.clear()


def graphs() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def grad_step(x: raggedfn.Ragged, p: Params) -> Any:
    """Gradients (parameters and token features) and loss of the nested map."""

    def loss(p: Params, values: torch.Tensor) -> torch.Tensor:
        return _loss(raggedfn.map(encode, x.with_values(values), p, in_dims=(0, None)))

    return torch.func.grad_and_value(loss, argnums=(0, 1))(p, x.values)


def loop_step(x: raggedfn.Ragged, p: Params) -> Any:
    def loss(p: Params, values: torch.Tensor) -> torch.Tensor:
        return _loss(_stack(_loop(encode, x.with_values(values), p)))

    return torch.func.grad_and_value(loss, argnums=(0, 1))(p, x.values)


def _assert_same(got: Any, expected: Any) -> None:
    (grad_p, grad_values), value = got
    (want_p, want_values), want = expected
    torch.testing.assert_close(value, want)
    for name in want_p:
        torch.testing.assert_close(grad_p[name], want_p[name], msg=name)
    torch.testing.assert_close(grad_values, want_values)


def test_torch_func_grad_inside_the_compiled_step_equals_eager_and_the_loop() -> None:
    """Inductor, traced on first use (no eager call of map before compiling)."""
    fresh()
    compiled = torch.compile(grad_step, fullgraph=True, dynamic=True)
    p = _params()
    for seed, shape in enumerate(DOCS):
        x = _documents(shape, seed)
        got = compiled(x, p)
        _assert_same(got, grad_step(x, p))
        _assert_same(got, loop_step(x, p))
    unique, breaks = graphs()
    # new lengths and batch sizes reuse the graph; as for one-level compiled map
    # (tests/test_map_compile.py), inductor may add one graph: its mm decomposition
    # guards the packed size of the first batch's small matmuls
    assert breaks == 0 and unique <= 2


def test_a_compiled_loss_backward_equals_the_loop_in_one_graph() -> None:
    fresh()
    p = _params()
    compiled = torch.compile(
        lambda x, p: _loss(raggedfn.map(encode, x, p, in_dims=(0, None))),
        fullgraph=True,
        dynamic=True,
        backend="aot_eager",
    )
    for seed, shape in enumerate(DOCS):
        x = _documents(shape, seed)
        leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
        values = x.values.clone().requires_grad_(True)
        compiled(x.with_values(values), leaves).backward()
        want_leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
        want_values = x.values.clone().requires_grad_(True)
        _loss(_stack(_loop(encode, x.with_values(want_values), want_leaves))).backward()
        for name in p:
            torch.testing.assert_close(leaves[name].grad, want_leaves[name].grad, msg=name)
        torch.testing.assert_close(values.grad, want_values.grad)
    # one graph for every batch: new lengths, empty documents and sentences, other B
    assert graphs() == (1, 0)


def test_a_lambda_made_in_the_region_and_a_module_read_their_tensors_afresh() -> None:
    """The record is made once; the tensors ``f`` captures are graph inputs: a weight
    changed in place or rebound gives the new answer without a new graph."""
    fresh()
    torch.manual_seed(0)
    encoder = _Encoder()
    x = _documents(DOCS[0])
    labels = torch.randn(x.batch_size, D, dtype=torch.float64)

    def module_step(x: raggedfn.Ragged, labels: torch.Tensor) -> torch.Tensor:
        return raggedfn.map(encoder, x, labels)

    def lambda_step(x: raggedfn.Ragged, p: Params) -> torch.Tensor:
        return raggedfn.map(lambda doc: encode(doc, p)[0] * 2.0, x)  # made in the region

    compiled_module = torch.compile(module_step, fullgraph=True, dynamic=True, backend="eager")
    compiled_lambda = torch.compile(lambda_step, fullgraph=True, dynamic=True, backend="eager")

    def expected(x: raggedfn.Ragged) -> torch.Tensor:
        return torch.stack([encoder(x[i], labels[i]) for i in range(x.batch_size)])

    with torch.no_grad():
        torch.testing.assert_close(compiled_module(x, labels), expected(x))
        encoder.token.weight.mul_(2.0)
        torch.testing.assert_close(compiled_module(x, labels), expected(x))
        encoder.token.weight = torch.nn.Parameter(torch.randn(D, D, dtype=torch.float64))
        torch.testing.assert_close(compiled_module(x, labels), expected(x))
        for seed in range(2):
            p = _params(seed)
            want = torch.stack([encode(x[i], p)[0] * 2.0 for i in range(x.batch_size)])
            torch.testing.assert_close(compiled_lambda(x, p), want)
    assert graphs() == (2, 0)  # one per compiled function


SCALE = {"value": 2.0}
W = torch.randn(D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def scaled(doc: raggedfn.Ragged) -> torch.Tensor:
    """Torch code on a captured tensor (made in the graph), a Python number it reads."""
    w = W.T * SCALE["value"]
    return raggedfn.sum(raggedfn.linear(doc, w[None].squeeze(0)), 1).sum(0)


def test_the_python_state_f_reads_is_guarded_and_a_rebound_global_read_afresh() -> None:
    global W
    fresh()
    x = _documents(DOCS[0])
    compiled = torch.compile(
        lambda x: raggedfn.map(scaled, x), fullgraph=True, dynamic=True, backend="eager"
    )
    saved = (SCALE["value"], W)
    try:
        torch.testing.assert_close(compiled(x), torch.stack(_loop(scaled, x)))
        W = torch.randn(D, D, dtype=torch.float64)  # rebound: a graph input, no new graph
        torch.testing.assert_close(compiled(x), torch.stack(_loop(scaled, x)))
        assert graphs()[0] == 1
        SCALE["value"] = 3.0  # a Python number f reads: recompiles with a new record
        torch.testing.assert_close(compiled(x), torch.stack(_loop(scaled, x)))
        assert graphs() == (2, 0)
    finally:
        SCALE["value"], W = saved


T = torch.tensor(2.0, dtype=torch.float64)


def _reads_data(doc: raggedfn.Ragged) -> torch.Tensor:
    return raggedfn.sum(doc, 1).sum(0) * float(T)  # the record would keep T's value


def _writes(doc: raggedfn.Ragged) -> torch.Tensor:
    T.add_(0.0)  # the record would run it once, while compiling
    return raggedfn.sum(doc, 1).sum(0)


REFUSED = {
    "len": (FALLBACKS["len"][0], "f reads the sample's length"),
    "no-batched-form": FALLBACKS["no-batched-form"],
    "captured-data": (_reads_data, "f reads a Python value from a tensor's data"),
    "captured-write": (_writes, "f writes into a tensor it was given"),
}


@pytest.mark.parametrize(("f", "reason"), list(REFUSED.values()), ids=list(REFUSED))
def test_what_only_the_loop_can_run_is_refused_under_fullgraph_and_runs_outside_it(
    f: Any, reason: str
) -> None:
    x = _documents(DOCS[0])
    fresh()
    strict = torch.compile(lambda x: raggedfn.map(f, x), fullgraph=True, backend="eager")
    # (dynamo re-raises map's RaggedError as its Unsupported, which carries the text)
    with pytest.raises(Exception, match="per-sample loop cannot run inside fullgraph") as error:
        strict(x)
    assert reason in str(error.value)
    assert "RaggedError" in str(error.value) or isinstance(error.value, raggedfn.RaggedError)
    fresh()
    loose = torch.compile(lambda x: raggedfn.map(f, x), backend="eager")
    with warnings.catch_warnings():  # the loop, or an eager batched run where it can
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        got = loose(x)
    _assert_samples(got, [f(x[i]) for i in range(x.batch_size)])


def _feature_sums(doc: raggedfn.Ragged) -> torch.Tensor:
    """Reads the feature width (the same in every document, so the record may)."""
    s = raggedfn.sum(doc, 1)
    return s.reshape(-1, s.shape[-1]).sum(0) * s.shape[-1]


def test_a_new_feature_width_is_recorded_anew() -> None:
    fresh()
    compiled = torch.compile(
        lambda x: raggedfn.map(_feature_sums, x), fullgraph=True, dynamic=True, backend="eager"
    )
    counts = [len(doc) for doc in DOCS[0]]
    rows = [n for doc in DOCS[0] for n in doc]
    for width in (4, 6, 4):
        x = raggedfn.from_nested_lengths(
            torch.randn(32, width, dtype=torch.float64), [counts, rows]
        )
        torch.testing.assert_close(compiled(x), torch.stack(_loop(_feature_sums, x)))


class _DocumentEncoder(torch.nn.Module):
    def __init__(self, p: Params) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: raggedfn.Ragged) -> torch.Tensor:
        return raggedfn.map(encode, x, self.p, in_dims=(0, None))[0]


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_with_dynamic_shapes_runs_new_batches(strict: bool) -> None:
    p = _params()
    x = _documents(DOCS[0])
    program = torch.export.export(
        _DocumentEncoder(p), (x,), dynamic_shapes=(raggedfn.dynamic_shapes(x),), strict=strict
    )
    for seed, shape in enumerate(DOCS[1:]):
        y = _documents(shape, seed)
        torch.testing.assert_close(program.module()(y), _stack(_loop(encode, y, p))[0])


def _half_frozen(doc: raggedfn.Ragged, w: torch.Tensor) -> torch.Tensor:
    """Torch code on a shared tensor under ``torch.no_grad()`` inside ``f``."""
    with torch.no_grad():
        frozen = w * 2.0
    return raggedfn.sum(raggedfn.linear(doc, frozen + w), 1).sum(0)


def test_torch_code_f_runs_under_no_grad_keeps_its_grad_mode_in_the_graph() -> None:
    fresh()
    x = _documents(DOCS[0])
    w = torch.randn(D, D, dtype=torch.float64)

    def step(x: raggedfn.Ragged, w: torch.Tensor) -> Any:
        return torch.func.grad(
            lambda w: raggedfn.map(_half_frozen, x, w, in_dims=(0, None)).pow(2).sum()
        )(w)

    def loop(w: torch.Tensor) -> torch.Tensor:
        return torch.stack(_loop(_half_frozen, x, w)).pow(2).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), torch.func.grad(loop)(w))


def test_a_per_document_lambda_made_inside_torch_func_grad_in_the_region() -> None:
    """The common style: the lambda captures the parameters the transform wraps."""
    fresh()
    p = _params()

    def step(x: raggedfn.Ragged, p: Params) -> Any:
        return torch.func.grad_and_value(
            lambda p: _loss(raggedfn.map(lambda doc: encode(doc, p), x))
        )(p)

    def loop(x: raggedfn.Ragged, p: Params) -> Any:
        return torch.func.grad_and_value(lambda p: _loss(_stack(_loop(encode, x, p))))(p)

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for seed, shape in enumerate(DOCS[:2]):
        x = _documents(shape, seed)
        (grads, value), (want, want_value) = compiled(x, p), loop(x, p)
        torch.testing.assert_close(value, want_value)
        for name in p:
            torch.testing.assert_close(grads[name], want[name], msg=name)
    assert graphs() == (1, 0)


def test_an_empty_batch_inside_the_region_raises_as_one_level_map_does() -> None:
    """B = 0 specializes a graph; the one-level map of the encoder's torch code refuses an
    empty batch inside the graph (a clear RaggedError, never a wrong answer)."""
    fresh()
    x = raggedfn.from_nested_lengths(torch.zeros(0, D, dtype=torch.float64), [[], []])
    compiled = torch.compile(
        lambda x, p: raggedfn.map(encode, x, p, in_dims=(0, None)),
        fullgraph=True,
        dynamic=True,
        backend="eager",
    )
    with pytest.raises(Exception, match="an empty batch"):
        compiled(x, _params())


def _contiguous(doc: raggedfn.Ragged, w: torch.Tensor) -> torch.Tensor:
    """``w.contiguous()`` returns ``w`` itself: a made result that is also an argument."""
    return raggedfn.sum(raggedfn.linear(doc, w.contiguous() * 2.0), 1).sum(0)


def test_torch_code_returning_its_own_input_is_replayed() -> None:
    fresh()
    x = _documents(DOCS[0])
    w = torch.randn(D, D, dtype=torch.float64)
    compiled = torch.compile(
        lambda x, w: raggedfn.map(_contiguous, x, w, in_dims=(0, None)),
        fullgraph=True,
        dynamic=True,
        backend="eager",
    )
    for _ in range(2):
        torch.testing.assert_close(compiled(x, w), torch.stack(_loop(_contiguous, x, w)))
        w = torch.randn(D, D, dtype=torch.float64)


_RANDOM_STEP = torch.compile(grad_step, fullgraph=True, dynamic=True, backend="eager")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.lists(st.integers(0, 4), max_size=4), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_random_documents_compiled_equal_the_loop(shape: list[list[int]], seed: int) -> None:
    """B >= 1 (an empty batch: see above); empty documents and sentences, B = 1."""
    x, p = _documents(shape, seed), _params(seed)
    _assert_same(_RANDOM_STEP(x, p), loop_step(x, p))


def test_map_cache_clear_forgets_the_records_kept_for_compiled_code() -> None:
    from raggedfn._map.entry import _compiled_nested

    fresh()
    compiled = torch.compile(
        lambda x: raggedfn.map(_feature_sums, x), fullgraph=True, dynamic=True, backend="eager"
    )
    counts = [len(doc) for doc in DOCS[0]]
    rows = [n for doc in DOCS[0] for n in doc]
    x = raggedfn.from_nested_lengths(torch.randn(32, 4, dtype=torch.float64), [counts, rows])
    expected = torch.stack(_loop(_feature_sums, x))
    torch.testing.assert_close(compiled(x), expected)
    kept = set(vars(_compiled_nested.PROGRAMS))
    assert kept and _compiled_nested._INDEX
    raggedfn.map_cache_clear()
    assert not vars(_compiled_nested.PROGRAMS) and not _compiled_nested._INDEX
    # the graph's guard on its record's holder fails: recompiled, recorded under a new id
    torch.testing.assert_close(compiled(x), expected)
    assert kept.isdisjoint(vars(_compiled_nested.PROGRAMS))
