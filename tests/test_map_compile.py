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


def fresh(t, p):
    return mlp(t, p) * 2


def test_compile_traces_on_first_use_without_an_eager_call():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = _step(fresh)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    params = mlp_params(torch.float32)
    for i in range(4):
        grads, value = compiled(*_batch(i, 8), params)
        grads_eager, value_eager = step(*_batch(i, 8), params)
        torch.testing.assert_close(value, value_eager, rtol=1e-4, atol=1e-5)
        for k in params:
            torch.testing.assert_close(grads[k], grads_eager[k], rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    assert raggedfn.map_cache_info(fresh).traces == 1


def _lambda_step(values, offsets, sizes, p):
    x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
    # the common style: a per-sample lambda made inside the loss at every call
    return torch.func.grad_and_value(
        lambda p: raggedfn.map(lambda t: mlp(t, p) * 3, x).values.pow(2).mean()
    )(p)


def test_a_lambda_made_inside_the_compiled_loss_uses_the_eager_trace():
    params = mlp_params(torch.float32)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_lambda_step, fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match="needs one eager call"):
        compiled(*_batch(0, 8), params)
    _lambda_step(*_batch(0, 8), params)  # the eager warm-up traces the lambda's code
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_lambda_step, fullgraph=True, dynamic=True)
    for i in range(4):
        grads, value = compiled(*_batch(i, 8), params)
        grads_eager, value_eager = _lambda_step(*_batch(i, 8), params)
        torch.testing.assert_close(value, value_eager, rtol=1e-4, atol=1e-5)
        for k in params:
            torch.testing.assert_close(grads[k], grads_eager[k], rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def flips(t, p):
    return torch.flip(mlp(t, p), [0])


def test_an_op_without_rule_inside_fullgraph_is_named():
    torch._dynamo.reset()
    compiled = torch.compile(_step(flips), fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match=r"aten\.flip\.default has no batching rule"):
        compiled(*_batch(1, 8), mlp_params(torch.float32))


class Tempered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.dropout = torch.nn.Dropout(0.5)
        self.temperature = 1.0

    def forward(self, t):
        return (self.dropout(self.linear(t)) / self.temperature).softmax(0)


def test_compiled_map_sees_module_state_and_rebound_parameters():
    torch.manual_seed(0)
    model = Tempered()

    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
        return raggedfn.map(model, x).values

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    model.eval()
    b = _batch(2, 8)
    torch.testing.assert_close(compiled(*b), step(*b))
    model.temperature = 0.5  # a Python number the trace read: a new trace and graph
    torch.testing.assert_close(compiled(*b), step(*b))
    with torch.no_grad():
        model.linear.weight = torch.nn.Parameter(model.linear.weight * -1)  # rebound
    torch.testing.assert_close(compiled(*b), step(*b))
    model.train()
    out = compiled(*b)
    assert (out == 0).any() or not torch.allclose(out, step(*b))  # dropout is active now
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3


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
