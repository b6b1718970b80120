"""Host-planned ops (attention, products contracting a ragged axis) inside torch.compile.

They run as one opaque custom-op node each (``_prims.host_planned``): compiled code
must equal eager in values and gradients, keep one graph across new lengths, raise
the eager errors at run time, and refuse (not silently mis-differentiate) what the
opaque node cannot do.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import raggedfn
from raggedfn import RaggedError

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

HEADS, DIM = 2, 3
WEIGHT = torch.linspace(-1, 1, HEADS * (DIM + 1), dtype=torch.float64).view(HEADS, DIM + 1)
BATCHES = ([3, 5, 1], [2, 6, 4, 0], [7, 1, 3], [4, 4, 4, 4, 2])


def tokens(lengths, seed, last=DIM):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), HEADS, last, generator=gen, dtype=torch.float64)
    return raggedfn.from_lengths(values.requires_grad_(True), torch.tensor(lengths))


def marked(*xs):
    for x in xs:
        raggedfn.mark_dynamic(x)
    return xs


def grads_of(fn, *xs):
    out = fn(*xs)
    leaves = [x.values for x in xs if x.values.requires_grad]
    return out, torch.autograd.grad(out, leaves)


def per_sample_attention(q, k, v, causal, kp, bias):
    """Reference: torch SDPA on each sample alone, heads in front."""
    outs = []
    for b, (qs, ks, vs) in enumerate(
        zip(raggedfn.unbind(q), raggedfn.unbind(k), raggedfn.unbind(v), strict=True)
    ):
        mask = None
        if kp is not None:
            mask = ~raggedfn.unbind(kp)[b].view(1, 1, -1)
        if causal:
            n, m = qs.shape[0], ks.shape[0]
            lower = torch.ones(n, m, dtype=torch.bool).tril()
            mask = lower if mask is None else mask & lower
        if bias is not None:
            add = bias[b]
            mask = add if mask is None else torch.where(mask, add, float("-inf"))
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("causal", "padding", "dense_bias"),
    [(False, False, False), (True, False, False), (False, True, True), (True, True, False)],
)
def test_compiled_attention_equals_eager_and_per_sample_sdpa(causal, padding, dense_bias):
    bias_t = torch.randn(5, HEADS, 1, 1, dtype=torch.float64) if dense_bias else None

    def loss(q, k, v, kp):
        bias = bias_t[: q.batch_size] if bias_t is not None else None
        out = raggedfn.attention(q, k, v, key_padding=kp, causal=causal, bias=bias)
        return (out.values * WEIGHT).sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for n, lengths in enumerate(BATCHES):
        q, k = tokens(lengths, 3 * n), tokens(lengths, 3 * n + 1)
        v = tokens(lengths, 3 * n + 2, last=DIM + 1)
        kp = None
        if padding:
            kp = raggedfn.from_lengths(torch.arange(sum(lengths)) % 3 == 1, torch.tensor(lengths))
            marked(kp)
        args = marked(q, k, v)
        got, got_grads = grads_of(lambda q, k, v, kp=kp: compiled(q, k, v, kp), *args)
        want, want_grads = grads_of(lambda q, k, v, kp=kp: loss(q, k, v, kp), q, k, v)
        torch.testing.assert_close(got, want)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w)
        bias = bias_t[: q.batch_size] if bias_t is not None else None
        reference = per_sample_attention(q, k, v, causal, kp, bias)
        direct = raggedfn.attention(q, k, v, key_padding=kp, causal=causal, bias=bias)
        torch.testing.assert_close(direct.values, reference)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_compiled_products_make_and_contract_pair_states_in_one_graph():
    """Scores as a new pair state (data-dependent row count), softmax along the key axis,
    contraction back to tokens, and a product with a dense result."""

    def loss(q, k, v):
        x, y, w = (raggedfn.flatten(t, 2, 3) for t in (q, k, v))
        scores = raggedfn.matmul(x, raggedfn.transpose(y, 1, 2))  # (B, N*, M*)
        out = raggedfn.matmul(raggedfn.softmax(scores, 2), w)  # (B, N*, D)
        pooled = raggedfn.einsum("bnd,bne->bde", out, x)  # dense [B, D, D]
        return (out.values**2).sum() + (pooled**2).sum() + (x + out).values.sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for n, lengths in enumerate(BATCHES):
        q, k, v = (tokens(lengths, 3 * n + j) for j in range(3))
        got, got_grads = grads_of(compiled, *marked(q, k, v))
        want, want_grads = grads_of(loss, q, k, v)
        torch.testing.assert_close(got, want)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_compiled_attention_raises_the_eager_error_at_run_time():
    compiled = torch.compile(
        lambda q, k, v: raggedfn.attention(q, k, v).values.sum(), backend="aot_eager"
    )
    q, k = tokens([3, 2], 0), tokens([3, 2], 1)
    v = tokens([2, 3], 2)
    with pytest.raises(RaggedError, match="k and v must have the same partition"):
        compiled(q, k, v)


def test_compiled_product_checks_that_result_rows_match_at_run_time():
    """A data-dependent row count meets another partition: equal partitions pass, different
    ones raise instead of silently adding misaligned rows."""

    def pair_plus(x, y):
        scores = raggedfn.matmul(
            raggedfn.flatten(x, 2, 3), raggedfn.transpose(raggedfn.flatten(x, 2, 3), 1, 2)
        )
        return (scores + y).values.sum()

    compiled = torch.compile(pair_plus, fullgraph=True, backend="aot_eager")
    x = tokens([3, 2], 0)
    good = raggedfn.from_sizes(torch.ones(13, dtype=torch.float64), torch.tensor([[3, 3], [2, 2]]))
    torch.testing.assert_close(compiled(x, good), pair_plus(x, good))
    bad = raggedfn.from_sizes(torch.ones(13, dtype=torch.float64), torch.tensor([[2, 2], [3, 3]]))
    with pytest.raises(Exception, match="different partitions"):
        compiled(x, bad)


def test_torch_func_grad_of_a_compiled_attention_raises_instead_of_a_wrong_gradient():
    """torch.func transforms cannot see through the opaque node: refused, never silently zero."""
    q = tokens([3, 2], 0)

    def f(values):
        x = q.with_values(values)
        return raggedfn.attention(x, x, x).values.sum()

    compiled = torch.compile(torch.func.grad(f), backend="aot_eager")
    # torch wraps it in its own error types; the cause is functorch refusing the custom op
    with pytest.raises(Exception, match="functorch transforms"):
        compiled(q.values.detach())
