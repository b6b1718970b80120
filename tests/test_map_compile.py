"""raggedfn.map inside torch.compile(fullgraph=True, dynamic=True) training steps."""

from __future__ import annotations

import pytest
import torch

import raggedfn
from tests.test_map import BERT, bert, mlp, mlp_params, tokens

LAYOUT = raggedfn.Layout.standard(1, 1)

# torch 2.13's dynamo instantiates ``torch.autograd.Function()`` for the ctx of every
# custom Function it traces (the segment primitives of the batching rules), which warns;
# the warning is torch's, not raggedfn's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def _step(f):
    def step(values, offsets, sizes, p):
        x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
        return torch.func.grad_and_value(
            lambda p: raggedfn.map(f, x, p, in_dims=(0, None)).values.pow(2).mean()
        )(p)

    return step


def _batch(i, dim):
    lengths = [3 + i, 2 + (i * 5) % 7, 4 + (i * 3) % 5][: 2 + i % 2]
    x = tokens(lengths, dim=dim, dtype=torch.float32, seed=i)
    return x.values, x.offsets, x.sizes


def _check_compiled(step, params, dim):
    step(*_batch(0, dim), params)  # traces f eagerly (the plan is cached per signature)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for i in range(10):
        b = _batch(i, dim)
        grads, value = compiled(*b, params)
        grads_eager, value_eager = step(*b, params)
        torch.testing.assert_close(value, value_eager, rtol=1e-4, atol=1e-5)
        for k in params:
            torch.testing.assert_close(grads[k], grads_eager[k], rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_compiled_mlp_training_step_has_no_graph_break_and_few_graphs():
    _check_compiled(_step(mlp), mlp_params(torch.float32), 8)


def test_compiled_bert_layer_training_step():
    # attention creates a new packed size (the pairs of each sample): its total is read
    # as an unbacked symbol, which needs capture_scalar_outputs (see docs/map.md)
    params = {k: v.detach().float() for k, v in BERT.named_parameters()}
    layer = BERT.float()
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            _check_compiled(_step(bert), params, 8)
    finally:
        layer.double()


def test_compile_without_an_eager_trace_is_refused():
    def fresh(t, p):
        return mlp(t, p) * 2

    torch._dynamo.reset()
    compiled = torch.compile(_step(fresh), fullgraph=True, dynamic=True)
    params = mlp_params(torch.float32)
    with pytest.raises(Exception, match="call the step once eagerly"):  # dynamo wraps it
        compiled(*_batch(1, 8), params)


def long_only(t, p):
    return mlp(t, p) * 2 if t.shape[0] > 2 else mlp(t, p)


def test_a_failing_guard_stops_a_compiled_step():
    step = _step(long_only)
    params = mlp_params(torch.float32)
    step(*_batch(1, 8), params)  # lengths (4, 7): the trace takes the long branch
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    _, value = compiled(*_batch(1, 8), params)
    torch.testing.assert_close(value, step(*_batch(1, 8), params)[1])
    short = tokens([3, 2], dim=8, dtype=torch.float32)  # sample 1 breaks s > 2
    with pytest.raises(RuntimeError, match="guard"):
        compiled(short.values, short.offsets, short.sizes, params)
