"""``raggedfn.map`` over a nested value runs batched: a per-document function written
with raggedfn ops (on the document, a one-level ``Ragged`` of sentences of tokens) and
plain torch on their dense results equals the per-document loop, in values and in
gradients (``torch.func.grad`` and ``.backward``), and ``map_report`` says
``fully_batched``; what the batched run cannot stand for runs the loop and says why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.reference import assert_same
from raggedfn._map.nested._replay import Segment

D = 4
Params = dict[str, torch.Tensor]


def _documents(shape: list[list[int]], seed: int = 0) -> raggedfn.Ragged:
    """Tokens per sentence of every document -> a nested value ``(B, S*, L*, D)``."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(map(sum, shape)), D, generator=gen, dtype=torch.float64)
    rows = [n for doc in shape for n in doc]
    return raggedfn.from_nested_lengths(values, [[len(d) for d in shape], rows])


SHAPES = {
    "mixed": [[2, 3], [], [1], [0, 4, 2], [3]],  # an empty document, an empty sentence
    "one-document": [[3, 1, 2]],
    "equal": [[2, 2], [2, 2]],
    "only-empty-sentences": [[0], [0, 0]],
}


def _params(seed: int = 1) -> Params:
    gen = torch.Generator().manual_seed(seed)

    def param(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64) / 2

    return {
        "w_token": param(D, D),
        "b_token": param(D),
        "u_token": param(D),
        "w_sentence": param(D, D),
        "u_sentence": param(D),
    }


def encode(doc: raggedfn.Ragged, p: Params) -> tuple[torch.Tensor, torch.Tensor]:
    """One document: token MLP, attention pooling of every sentence's tokens (softmax
    over tokens), then plain torch on the sentence vectors (softmax over sentences, a
    sum over sentences); also the sum of every token's features (over sentences and
    tokens at once)."""
    h = raggedfn.apply(F.gelu, raggedfn.linear(doc, p["w_token"], p["b_token"]))
    scores = raggedfn.softmax(raggedfn.linear(h, p["u_token"][None]), 1)  # over tokens
    sentences = raggedfn.sum(scores * h, 1)  # (S, D)
    assert isinstance(sentences, torch.Tensor)
    s = torch.tanh(F.linear(F.layer_norm(sentences, sentences.shape[-1:]), p["w_sentence"]))
    weights = torch.softmax(s @ p["u_sentence"], 0)  # over sentences
    pooled = (weights[:, None] * s).sum(0)  # (D,)
    return pooled, raggedfn.sum(h) + pooled.sum()


def _loop(f: Callable[..., Any], x: raggedfn.Ragged, *shared: Any) -> list[Any]:
    return [f(x[i], *shared) for i in range(x.batch_size)]


def _stack(outs: list[Any]) -> Any:
    return tuple(torch.stack(parts) for parts in zip(*outs, strict=True))


def _quiet_map(f: Callable[..., Any], x: raggedfn.Ragged, *shared: Any) -> Any:
    """``map`` with every ``RaggedPerformanceWarning`` an error (no loop may run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", raggedfn.RaggedPerformanceWarning)
        return raggedfn.map(f, x, *shared, in_dims=(0,) + (None,) * len(shared))


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_a_document_encoder_runs_batched_and_equals_the_loop(shape: list[list[int]]) -> None:
    x, p = _documents(shape), _params()
    calls = []

    def f(doc: raggedfn.Ragged, p: Params) -> Any:
        calls.append(1)
        return encode(doc, p)

    report = raggedfn.map_report(f, x, p, in_dims=(0, None))
    assert report.fully_batched, str(report)
    assert report.batched["raggedfn.softmax"] == 1 and report.batched["raggedfn.linear"] == 2
    calls.clear()
    raggedfn.map_cache_clear()  # a record of f's code is kept across calls: a cold call
    got = _quiet_map(f, x, p)
    assert len(calls) == 1  # once, on the stand-in sample: not once per document
    expected = _stack(_loop(encode, x, p))
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs)


def _loss(outs: Any) -> torch.Tensor:
    pooled, total = outs
    return pooled.pow(2).sum() + total.sin().sum()


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_gradients_equal_the_loop_under_torch_func_grad(shape: list[list[int]]) -> None:
    x, p = _documents(shape), _params()

    def batched(p: Params, values: torch.Tensor) -> torch.Tensor:
        return _loss(raggedfn.map(encode, x.with_values(values), p, in_dims=(0, None)))

    def loop(p: Params, values: torch.Tensor) -> torch.Tensor:
        return _loss(_stack(_loop(encode, x.with_values(values), p)))

    got = torch.func.grad(batched, argnums=(0, 1))(p, x.values)
    expected = torch.func.grad(loop, argnums=(0, 1))(p, x.values)
    for name in p:
        torch.testing.assert_close(got[0][name], expected[0][name], msg=name)
    torch.testing.assert_close(got[1], expected[1])


def test_gradients_equal_the_loop_with_backward() -> None:
    x, p = _documents(SHAPES["mixed"]), _params()
    leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    values = x.values.clone().requires_grad_(True)
    _loss(_quiet_map(encode, x.with_values(values), leaves)).backward()
    grads = {k: v.grad for k, v in leaves.items()}
    expected_leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    expected_values = x.values.clone().requires_grad_(True)
    _loss(_stack(_loop(encode, x.with_values(expected_values), expected_leaves))).backward()
    for name in p:
        torch.testing.assert_close(grads[name], expected_leaves[name].grad, msg=name)
    torch.testing.assert_close(values.grad, expected_values.grad)


REDUCTIONS: dict[str, Callable[[raggedfn.Ragged], Any]] = {
    "mean-over-tokens": lambda doc: raggedfn.mean(doc, 1),  # (S, D); NaN for empty sentences
    "mean-of-document": lambda doc: raggedfn.mean(doc),  # every axis: one number
    "sum-over-tokens-and-features": lambda doc: raggedfn.sum(doc, (1, 2)),  # (S,)
    "amax-over-tokens": lambda doc: raggedfn.amax(doc, -2),  # a negative axis
    "log-softmax-then-logsumexp": lambda doc: raggedfn.logsumexp(raggedfn.log_softmax(doc, 1), 1),
    "ragged-result": lambda doc: raggedfn.softmax(doc * 2.0 - 1.0, 1),  # nested output
    "torch-mean-over-sentences": lambda doc: raggedfn.sum(doc, 1).mean(0),
    "keepdim": lambda doc: raggedfn.sum(doc, 1, keepdim=True) + 1.0,
}


@pytest.mark.parametrize("f", list(REDUCTIONS.values()), ids=list(REDUCTIONS))
def test_reductions_over_tokens_and_sentences_equal_the_loop(
    f: Callable[[raggedfn.Ragged], Any],
) -> None:
    x = _documents(SHAPES["mixed"])
    assert raggedfn.map_report(f, x).fully_batched
    got = _quiet_map(f, x)
    _assert_samples(got, _loop(f, x))


def _assert_samples(got: Any, expected: list[Any]) -> None:
    """``got`` (a batched result) holds ``expected`` (the loop's), sample by sample."""
    if not isinstance(got, raggedfn.Ragged):
        torch.testing.assert_close(got, torch.stack(expected), equal_nan=True)
        return
    assert got.batch_size == len(expected)
    for i, want in enumerate(expected):
        mine = got[i]
        if isinstance(want, raggedfn.Ragged):  # a nested result: one sentence at a time
            assert isinstance(mine, raggedfn.Ragged) and mine.batch_size == want.batch_size
            for j in range(want.batch_size):
                torch.testing.assert_close(mine[j], want[j], equal_nan=True)
        else:
            torch.testing.assert_close(mine, want, equal_nan=True)


FALLBACKS: dict[str, tuple[Callable[[raggedfn.Ragged], Any], str]] = {
    "len": (lambda doc: raggedfn.sum(doc, 1) * len(doc), "f reads the sample's length"),
    "sentence-count": (
        lambda doc: raggedfn.sum(doc, 1) / raggedfn.sum(doc, 1).shape[0],
        "f reads a size that follows the sample (t.shape[0])",
    ),
    "size-call": (
        lambda doc: raggedfn.sum(doc, 1) * raggedfn.sum(doc, 1).size(0),
        "f reads a size that follows the sample",
    ),
    "data": (lambda doc: raggedfn.sum(doc, 1) * float(raggedfn.sum(doc)), "__float__"),
    "write": (lambda doc: raggedfn.sum(doc, 1).mul_(2.0), "f writes into a per-sample tensor"),
    "nonzero": (
        lambda doc: torch.ones(raggedfn.sum(doc, 1).nonzero().shape[0]),
        "sizes follow the sample's data",
    ),
    "values": (lambda doc: doc.values.sum(0), "f reads the sample's 'values'"),
    "no-batched-form": (
        lambda doc: raggedfn.sum(raggedfn.transpose(doc, 1, 2), 2),
        "raggedfn.transpose on a sample has no batched form yet",
    ),
    "mixed-operands": (
        lambda doc: raggedfn.mul(doc, raggedfn.sum(doc, (1, 2))[:, None, None]),
        "a sample and a per-sample dense tensor",
    ),
    "python-number": (lambda doc: 1.0, "f returns float"),
    "map-inside-f": (
        lambda doc: raggedfn.map(lambda t: t.sum(0), doc),
        "f calls raggedfn.map on a value of the sample",
    ),
    "autograd-state": (
        lambda doc: raggedfn.sum(doc, 1) * raggedfn.sum(doc, 1).requires_grad,
        "f reads the autograd state of a per-sample tensor",
    ),
}


@pytest.mark.parametrize(("f", "reason"), list(FALLBACKS.values()), ids=list(FALLBACKS))
def test_what_a_batched_run_cannot_stand_for_runs_the_loop_and_says_why(
    f: Callable[[raggedfn.Ragged], Any], reason: str
) -> None:
    x = _documents(SHAPES["mixed"])
    report = raggedfn.map_report(f, x)
    assert not report.fully_batched
    assert report.whole_loop is not None and reason in report.whole_loop, report.whole_loop
    with pytest.raises(raggedfn.RaggedError, match="strict=True refuses"):
        raggedfn.map(f, x, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        got = raggedfn.map(f, x)
    expected = _loop(f, x)
    _assert_samples(
        got, [e if isinstance(e, raggedfn.Ragged) else torch.as_tensor(e) for e in expected]
    )


def test_static_sizes_of_per_sample_tensors_may_be_read() -> None:
    """``t.shape[-1]``, ``t.size(-1)``, ``t.ndim`` and ``t.dtype`` do not follow the sample."""
    x = _documents(SHAPES["mixed"])

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        s = raggedfn.sum(doc, 1)
        assert s.ndim == 2 and s.dtype == torch.float64
        return s.reshape(-1, s.shape[-1] * s.size(-1) // D).sum(0)

    assert raggedfn.map_report(f, x).fully_batched
    torch.testing.assert_close(_quiet_map(f, x), torch.stack(_loop(f, x)))


def test_an_empty_batch_gives_an_empty_result() -> None:
    x = raggedfn.from_nested_lengths(torch.zeros(0, D, dtype=torch.float64), [[], []])
    report = raggedfn.map_report(encode, x, _params(), in_dims=(0, None))
    assert report.whole_loop is None  # recorded and run on the batch (one-level map's
    # own rules for an empty batch may still name ops that had no sample to run on)
    pooled, total = report.output
    assert pooled.shape == (0, D) and total.shape == (0,)


def test_warm_calls_reuse_the_trace_of_the_torch_code() -> None:
    x, p = _documents(SHAPES["mixed"]), _params()
    _quiet_map(encode, x, p)
    traces = raggedfn.map_cache_info(Segment((), (), ())).traces
    for seed in range(3):  # other lengths, same structure: no new trace
        _quiet_map(encode, _documents([[2, 1], [3, 3, 1]], seed), p)
    assert raggedfn.map_cache_info(Segment((), (), ())).traces == traces


def test_under_torch_compile_it_runs_batched() -> None:
    """(More in tests/test_nested_map_compile.py.)"""
    x = _documents(SHAPES["mixed"])

    @torch.compile(fullgraph=True, backend="eager")
    def g(values: torch.Tensor) -> Any:
        return raggedfn.map(lambda doc: raggedfn.sum(doc, 1), x.with_values(values))

    _assert_samples(g(x.values), _loop(lambda doc: raggedfn.sum(doc, 1), x))


def test_a_warm_call_that_goes_another_way_is_recorded_afresh() -> None:
    """The last record's example results are reused only while ops and argument shapes
    match: a different branch, or a weight of another shape, computes them again."""
    x = _documents(SHAPES["mixed"])
    state = {"pool": True}

    def f(doc: raggedfn.Ragged, w: torch.Tensor) -> torch.Tensor:
        h = raggedfn.linear(doc, w)
        if state["pool"]:
            return raggedfn.sum(raggedfn.softmax(h, 1) * h, 1).sum(0)
        s = raggedfn.sum(h, 1)  # (S, E): its width is read (a stale example's would be wrong)
        return s.reshape(-1, s.shape[-1]).sum(0) * s.shape[-1]

    for pool, width in ((True, D), (True, D), (False, D), (True, 3), (False, 5)):
        state["pool"] = pool
        w = torch.randn(width, D, dtype=torch.float64)
        report = raggedfn.map_report(f, x, w, in_dims=(0, None))
        assert report.fully_batched
        _assert_samples(report.output, _loop(f, x, w))


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = torch.nn.Linear(D, D, dtype=torch.float64)
        self.sentence = torch.nn.Linear(D, D, dtype=torch.float64)

    def forward(self, doc: raggedfn.Ragged, label: torch.Tensor) -> torch.Tensor:
        h = raggedfn.linear(doc, self.token.weight, self.token.bias)  # a module's weights
        return self.sentence(raggedfn.sum(h, 1)).sum(0) * label  # label: this document's


def test_a_module_two_nested_arguments_and_a_mapped_dense_argument() -> None:
    torch.manual_seed(0)
    x = _documents(SHAPES["mixed"])
    y = x.with_values(torch.randn_like(x.values))
    labels = torch.randn(x.batch_size, D, dtype=torch.float64)
    encoder = _Encoder()
    report = raggedfn.map_report(encoder, x, labels)
    assert report.fully_batched
    expected = [encoder(x[i], labels[i]) for i in range(x.batch_size)]
    torch.testing.assert_close(report.output, torch.stack(expected))

    def mixed(a: raggedfn.Ragged, b: raggedfn.Ragged) -> torch.Tensor:
        return raggedfn.sum(raggedfn.where(a > 0, a, b * 2.0), 1).sum(0)

    report = raggedfn.map_report(mixed, x, y)
    assert report.fully_batched
    expected = [mixed(x[i], y[i]) for i in range(x.batch_size)]
    torch.testing.assert_close(report.output, torch.stack(expected))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.lists(st.integers(0, 4), max_size=4), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_random_documents_equal_the_loop_in_values_and_gradients(
    shape: list[list[int]], seed: int
) -> None:
    x, p = _documents(shape, seed), _params(seed)

    def batched(p: Params) -> torch.Tensor:
        return _loss(raggedfn.map(encode, x, p, in_dims=(0, None)))

    def loop(p: Params) -> torch.Tensor:
        return _loss(_stack(_loop(encode, x, p)))

    torch.testing.assert_close(batched(p), loop(p))
    got, expected = torch.func.grad(batched)(p), torch.func.grad(loop)(p)
    for name in p:
        torch.testing.assert_close(got[name], expected[name], msg=name)


def test_the_report_holds_the_ops_of_the_torch_code_between_raggedfn_ops() -> None:
    """The segments of plain torch code run through one-level ``map``: ``map_report``
    over the nested value lists their batched ops and their per-sample loops."""
    x = _documents(SHAPES["mixed"])

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        return torch.tanh(raggedfn.sum(doc, 1)) * 2  # (S, D): a segment of torch code

    report = raggedfn.map_report(f, x)
    assert report.whole_loop is None and report.fully_batched, str(report)
    assert report.batched["raggedfn.sum"] == 1
    assert report.batched["aten.tanh.default"] == 1 and report.batched["aten.mul.Tensor"] == 1
    assert_same(report.output, _loop(f, x))

    def g(doc: raggedfn.Ragged) -> torch.Tensor:
        return torch.flip(torch.tanh(raggedfn.sum(doc, 1)), [0])  # flip: no batching rule

    report = raggedfn.map_report(g, x)
    assert report.whole_loop is None and not report.fully_batched
    assert report.batched["aten.tanh.default"] == 1
    where = "aten.flip.default (segment 0 of torch code on per-sample tensors)"
    assert report.fallback == {where: "no batching rule"}
    assert_same(report.output, _loop(g, x))


def test_keyword_arguments_of_a_metadata_read_reach_torch() -> None:
    """``Tensor.__repr__`` reads no sample data given ``tensor_contents`` (a keyword):
    on a dense per-sample value it answers as on each sample (every document has a
    sentence here: an empty tensor's repr names its size)."""
    x = _documents([[2, 3], [1], [0, 4, 2], [3]])

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        d = raggedfn.sum(doc, 1)
        return d * len(d.__repr__(tensor_contents="..."))

    report = raggedfn.map_report(f, x)
    assert report.fully_batched, str(report)
    assert_same(report.output, _loop(f, x))


class _DoublingTanh(torch.overrides.TorchFunctionMode):
    """A user's mode that changes results: every ``torch.tanh`` is doubled."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.tanh else out


def test_under_a_users_torch_function_mode_it_equals_the_loop_under_the_same_mode() -> None:
    # the mode sees every torch call of f: batched, it would see the stand-ins' and the
    # batch's calls (tanh doubled twice), not the loop's
    x = _documents(SHAPES["mixed"])

    def f(doc: raggedfn.Ragged) -> torch.Tensor:
        return torch.tanh(raggedfn.sum(doc, 1)).sum(0)

    raggedfn.map(f, x)  # a kept record of f from outside the mode must not serve it
    with _DoublingTanh():
        with pytest.warns(raggedfn.RaggedPerformanceWarning, match="_DoublingTanh"):
            got = raggedfn.map(f, x)
        expected = _loop(f, x)
    _assert_samples(got, expected)
    with torch.device("cpu"):  # torch's own default-device mode changes nothing: batched
        assert raggedfn.map_report(f, x).fully_batched
