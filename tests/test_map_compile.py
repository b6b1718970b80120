"""raggedfn.map inside torch.compile(fullgraph=True, dynamic=True) training steps."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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


def _inner_code(fn, depth=2):
    """The code object of the function made ``depth`` levels inside ``fn`` (a lambda in
    a lambda): the key of its trace in map's cache."""
    code = fn.__code__
    for _ in range(depth):
        code = next(c for c in code.co_consts if hasattr(c, "co_code"))
    return code


def test_a_lambda_made_inside_the_compiled_loss_traces_without_an_eager_call():
    params = mlp_params(torch.float32)
    code = _inner_code(_lambda_step)
    assert raggedfn._map.caching._cache.CACHE.get(code) is None  # no eager call traced it
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
    # traced while compiling, from the real function rebuilt out of dynamo's view of the
    # lambda; the eager calls found that trace
    assert raggedfn._map.caching._cache.CACHE[code].traces == 1


COLD = textwrap.dedent(
    """
    import warnings
    import torch, torch._dynamo.testing, raggedfn
    from raggedfn._map.caching import _cache

    warnings.simplefilter("error")
    warnings.filterwarnings(
        "ignore", ".*autograd.function.Function'> should not be instantiated", DeprecationWarning
    )
    torch.manual_seed(3)
    LINEAR = torch.nn.Linear(8, 8, dtype=torch.float64)

    def linear_step(x):
        # the user's style: the per-sample lambda made in the step, over a global module
        f = lambda t: torch.tanh(LINEAR(t)).sum(0)
        return raggedfn.map(f, x).pow(2).sum()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(
                8, 2, 16, dropout=0.0, batch_first=True, dtype=torch.float64
            )

        def forward(self, x):
            # a lambda capturing self: a closure cell only dynamo's variable holds
            f = lambda t: self.layer(t[None])[0] * t.shape[0]
            return raggedfn.map(f, x).values.pow(2).sum()

    encoder = Encoder()
    cases = [
        ("linear", linear_step, LINEAR, lambda t: torch.tanh(LINEAR(t)).sum(0).pow(2).sum()),
        ("encoder", encoder, encoder, lambda t: (encoder.layer(t[None])[0] * len(t)).pow(2).sum()),
    ]
    for name, step, module, per_sample in cases:
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
        params = list(module.parameters())
        for i in range(4):
            gen = torch.Generator().manual_seed(i)
            lengths = [3 + i, 2 + 2 * i, 5][: 2 + i % 2]
            x = raggedfn.from_list(
                [torch.randn(n, 8, generator=gen, dtype=torch.float64) for n in lengths]
            )
            got = torch.autograd.grad(compiled(x), params)
            # the reference: the per-sample loop, eagerly
            loss = sum(per_sample(t) for t in raggedfn.unbind(x))
            for g, w in zip(got, torch.autograd.grad(loss, params), strict=True):
                torch.testing.assert_close(g, w)
        assert counter.frame_count == 1, (name, counter.frame_count)
        # traced once, while compiling (no eager call of map ever ran in this process)
        assert [e.traces for e in _cache.CACHE.values()][-1] == 1, name
    print("ok")
    """
)


def test_a_step_making_its_lambda_compiles_in_a_fresh_process():
    """No eager call first, in a fresh process (map's plain-Python memos start empty): a
    lambda over a global Linear, and one capturing ``self`` of a module with a
    TransformerEncoderLayer, each one graph over four batches, gradients equal to the
    loop's."""
    result = subprocess.run(
        [sys.executable, "-c", COLD], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_a_lambda_whose_capture_has_no_real_value_says_what_to_do(monkeypatch):
    from raggedfn._map.tracing import _dynamo_reads

    def no_real_value(*args):
        raise LookupError("a captured SomethingVariable")

    def step(values, offsets, sizes, p):
        x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
        return raggedfn.map(lambda t: mlp(t, p) * 5, x).values.sum()  # no trace yet

    monkeypatch.setattr(_dynamo_reads, "_rebuild", no_real_value)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
    # (dynamo re-raises map's RaggedError as its Unsupported, which carries the text)
    with pytest.raises(Exception, match="call the step once eagerly first") as error:
        compiled(*_batch(0, 8), mlp_params(torch.float32))
    assert "SomethingVariable" in str(error.value)


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
