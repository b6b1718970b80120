"""Every path of attention and of the per-sample products, forced one at a time.

Each test makes the op take one path (asserted with a spy on that path's
function), then compares it with torch run on each sample alone and with the
other paths, in values and gradients, with every optional argument (``scale``,
``causal``, ``bias``, ``key_padding``). The compiled paths (the varlen custom op,
its equal-length batched call, the host-planned node) are compared with eager and
their graph counts asserted. ``docs/testing.md`` lists which test forces which branch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import raggedfn
from property_tests._pairs_helpers import tight_buckets
from property_tests.reference import samples
from property_tests.test_attention_props import sdpa_sample
from raggedfn import Ragged
from raggedfn._prims import _varlen
from raggedfn.ops import _attention, _bucket, _products

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

HEADS, DIM = 2, 3
DISTINCT = ([3, 0, 5, 2], [4, 2, 5, 1])  # query and key lengths, one empty sample
EQUAL = ([3, 3, 3], [4, 4, 4])


@contextmanager
def spy(module: Any, name: str) -> Iterator[list[int]]:
    """Count the calls of ``module.name`` inside the block (still calling it)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def packed(lengths: list[int], seed: int, last: int = DIM, dtype=torch.float64) -> Ragged:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), HEADS, last, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def options(n_lengths: list[int], m_lengths: list[int], bias: str, padding: bool) -> dict:
    gen = torch.Generator().manual_seed(7)
    batch = len(n_lengths)
    kwargs: dict[str, Any] = {}
    if bias in ("pair", "pair_grad"):
        sizes = torch.tensor(list(zip(n_lengths, m_lengths, strict=True)), dtype=torch.int64)
        count = sum(n * m for n, m in zip(n_lengths, m_lengths, strict=True))
        values = torch.randn(count, HEADS, generator=gen, dtype=torch.float64)
        kwargs["bias"] = raggedfn.from_sizes(values.requires_grad_(bias == "pair_grad"), sizes)
    elif bias == "heads":  # shared by every sample: (H, 1, 1)
        kwargs["bias"] = torch.randn(HEADS, 1, 1, generator=gen, dtype=torch.float64)
    elif bias == "per_sample":  # one row per sample, with a gradient: (B, H, 1, 1)
        kwargs["bias"] = torch.randn(batch, HEADS, 1, 1, generator=gen, dtype=torch.float64)
        kwargs["bias"].requires_grad_(True)
    if padding:
        flags = torch.rand(sum(m_lengths), generator=gen) < 0.4
        kwargs["key_padding"] = raggedfn.from_lengths(flags, torch.tensor(m_lengths))
    return kwargs


def sample_bias(kwargs: dict, b: int, n: int, m: int) -> torch.Tensor | None:
    bias = kwargs.get("bias")
    if isinstance(bias, Ragged):
        return samples(bias)[b]
    if isinstance(bias, torch.Tensor):
        row = bias[b] if bias.ndim == 4 else bias
        return row.permute(1, 2, 0).expand(n, m, HEADS)
    return None


def reference(q, k, v, kwargs, causal, scale) -> list[torch.Tensor]:
    """torch SDPA on each sample alone (differentiable in the per-sample leaves)."""
    paddings = samples(kwargs["key_padding"]) if "key_padding" in kwargs else None
    outs = []
    for b, (qs, ks, vs) in enumerate(zip(samples(q), samples(k), samples(v), strict=True)):
        bias = sample_bias(kwargs, b, qs.shape[0], ks.shape[0])
        pad = paddings[b] if paddings is not None else None
        outs.append(sdpa_sample(qs, ks, vs, bias, pad, causal, scale))
    return outs


def leaves_of(q, k, v, kwargs) -> list[torch.Tensor]:
    found = [q.values, k.values, v.values]
    bias = kwargs.get("bias")
    if isinstance(bias, Ragged) and bias.values.requires_grad:
        found.append(bias.values)
    elif isinstance(bias, torch.Tensor) and bias.requires_grad:
        found.append(bias)
    return found


def check_attention(run: Callable[..., Ragged], n_lengths, m_lengths, bias, padding, causal, scale):
    """``run(q, k, v, **kwargs)`` equals per-sample SDPA in values and gradients."""
    q, k = packed(n_lengths, 0), packed(m_lengths, 1)
    v = packed(m_lengths, 2, last=DIM + 1)
    for t in (q, k, v):
        t.values.requires_grad_(True)
    kwargs = options(n_lengths, m_lengths, bias, padding)
    out = run(q, k, v, causal=causal, scale=scale, **kwargs)
    # separate leaves for the reference side, cut per sample by reference.samples
    qs, ks, vs = (t.with_values(t.values.detach().clone().requires_grad_(True)) for t in (q, k, v))
    want = reference(qs, ks, vs, kwargs, causal, scale)
    got = samples(out)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    gen = torch.Generator().manual_seed(3)
    cotangent = torch.randn(out.values.shape, generator=gen, dtype=torch.float64)
    leaves = leaves_of(q, k, v, kwargs)
    mine = torch.autograd.grad(
        out.values, leaves, cotangent, allow_unused=True, materialize_grads=True
    )
    want_out = torch.cat([w.reshape(-1, *w.shape[1:]) for w in want]) if want else out.values * 0
    theirs_leaves = [t.values for t in (qs, ks, vs)] + leaves[3:]
    theirs = torch.autograd.grad(
        want_out, theirs_leaves, cotangent, allow_unused=True, materialize_grads=True
    )
    for name, a, b in zip(["q", "k", "v", "bias"], mine, theirs, strict=False):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"grad of {name}: {m}")
    return out


EAGER_PATHS = {
    # path: (spied module, function, lengths, biases allowed, padding allowed)
    "uniform": (_attention, "_uniform", EQUAL, ["none"], [False]),
    "views": (_attention, "_per_sample_views", DISTINCT, ["none"], [False]),
    "copies": (
        _attention,
        "_per_sample",
        DISTINCT,
        ["none", "pair", "pair_grad", "heads", "per_sample"],
        [False, True],
    ),
    "buckets": (
        _bucket,
        "plan",
        DISTINCT,
        ["none", "pair", "pair_grad", "heads", "per_sample"],
        [False, True],
    ),
}


def eager_cases() -> Iterator[Any]:
    for path, (_, _, _, biases, paddings) in EAGER_PATHS.items():
        for bias in biases:
            for padding in paddings:
                if path == "copies" and bias == "none" and not padding:
                    continue  # that is the views path
                for causal, scale in ((False, None), (True, 0.7)):
                    yield pytest.param(path, bias, padding, causal, scale, id=f"{path}-{bias}-{'pad' if padding else 'nopad'}-{'causal' if causal else 'full'}-{scale}")  # fmt: skip


@pytest.mark.parametrize(("path", "bias", "padding", "causal", "scale"), list(eager_cases()))
def test_eager_attention_path_equals_per_sample_sdpa(path, bias, padding, causal, scale):
    module, name, (n_lengths, m_lengths), _, _ = EAGER_PATHS[path]
    buckets = tight_buckets() if path == "buckets" else torch.enable_grad()
    with buckets, spy(module, name) as calls:
        check_attention(raggedfn.attention, n_lengths, m_lengths, bias, padding, causal, scale)
    assert calls, f"attention did not take the {path} path"


@pytest.mark.parametrize("heavy", [False, True])
def test_large_batch_views_or_buckets_with_scale(heavy, monkeypatch):
    """B > LOOP_MAX_BATCH: the work threshold picks views or buckets; both with a scale."""
    lengths = [1 + (5 * b) % 7 for b in range(_attention.LOOP_MAX_BATCH + 3)]
    monkeypatch.setattr(_attention, "VIEWS_MIN_WORK", 0 if heavy else float("inf"))
    with spy(_attention, "_per_sample_views") as views, spy(_bucket, "plan") as planned:
        check_attention(raggedfn.attention, lengths, lengths[::-1], "none", False, True, 1.3)
    assert (len(views), len(planned)) == ((1, 0) if heavy else (0, 1))


def test_uniform_path_declines_a_non_standard_layout():
    """Equal lengths stored (Dh, H): _uniform returns None and one unpadded bucket runs."""
    gen = torch.Generator().manual_seed(4)
    stored = torch.randn(9, DIM, HEADS, generator=gen, dtype=torch.float64)
    q = raggedfn.transpose(raggedfn.from_lengths(stored, [3, 3, 3]), -1, -2)
    with spy(_attention, "_uniform") as uniform, spy(_bucket, "plan") as planned:
        out = raggedfn.attention(q, q, q, scale=0.5, causal=True)
    assert uniform and planned
    want = torch.cat([sdpa_sample(s, s, s, causal=True, scale=0.5) for s in samples(q)])
    torch.testing.assert_close(torch.cat(samples(out)), want)


# ----- compiled attention -----------------------------------------------------------------

_COMPILED: dict[tuple[bool, float | None, bool], Callable[..., Any]] = {}


def compiled_attention(causal: bool, scale: float | None, padded: bool) -> Callable[..., Any]:
    """One compiled function per static option set, shared by the tests below."""
    key = (causal, scale, padded)
    if key not in _COMPILED:

        def f(q, k, v, key_padding=None):
            return raggedfn.attention(q, k, v, key_padding=key_padding, causal=causal, scale=scale)

        _COMPILED[key] = torch.compile(f, fullgraph=True, backend="aot_eager")
    return _COMPILED[key]


@pytest.mark.parametrize(
    ("causal", "scale"), [(False, 0.7), (True, None), (True, 1.3)], ids=["scale", "causal", "both"]
)
def test_compiled_plain_attention_takes_the_varlen_op_with_every_option(causal, scale):
    """Same head size for q, k and v, no bias/padding: the varlen custom op, both its
    per-sample loop (distinct lengths) and its one batched call (equal lengths); equal to
    eager and to SDPA per sample, one graph for both batches."""
    torch._dynamo.reset()
    counters.clear()
    compiled = compiled_attention(causal, scale, False)
    for n_lengths, uniform in ((DISTINCT[0], False), (EQUAL[0], True)):
        q, k, v = (packed(n_lengths, seed) for seed in range(3))
        for t in (q, k, v):
            raggedfn.mark_dynamic(t)
            t.values.requires_grad_(True)
        with spy(_varlen, "_batched") as batched, spy(_varlen, "_head_views") as looped:
            out = compiled(q, k, v)
            grads = torch.autograd.grad(out.values.sum(), [q.values, k.values, v.values])
        assert (bool(batched), bool(looped)) == (uniform, not uniform)
        eager = raggedfn.attention(q, k, v, causal=causal, scale=scale)
        eager_grads = torch.autograd.grad(eager.values.sum(), [q.values, k.values, v.values])
        torch.testing.assert_close(out.values, eager.values)
        for a, b in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(a, b)
        want = [sdpa_sample(a, b, c, causal=causal, scale=scale) for a, b, c in zip(samples(q), samples(k), samples(v), strict=True)]  # fmt: skip
        torch.testing.assert_close(out.values, torch.cat(want))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_masked_attention_takes_the_host_planned_node_with_scale(causal):
    """key_padding: the host-planned node (eager plan inside), with a scale and causal."""
    torch._dynamo.reset()
    counters.clear()
    compiled = compiled_attention(causal, 0.6, True)
    for n_lengths in (DISTINCT[0], [2, 4, 1]):
        q, k, v = (packed(n_lengths, seed) for seed in range(3))
        flags = torch.arange(sum(n_lengths)) % 3 == 1
        kp = raggedfn.from_lengths(flags, torch.tensor(n_lengths))
        for t in (q, k, v, kp):
            raggedfn.mark_dynamic(t)
        for t in (q, k, v):
            t.values.requires_grad_(True)
        with spy(_attention, "_attention") as planned:  # run by the host-planned impl
            out = compiled(q, k, v, kp)
            grads = torch.autograd.grad(out.values.sum(), [q.values, k.values, v.values])
        assert planned
        eager = raggedfn.attention(q, k, v, key_padding=kp, causal=causal, scale=0.6)
        eager_grads = torch.autograd.grad(eager.values.sum(), [q.values, k.values, v.values])
        torch.testing.assert_close(out.values, eager.values)
        for a, b in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(a, b)
        want = [sdpa_sample(a, b, c, key_padding=p, causal=causal, scale=0.6) for a, b, c, p in zip(samples(q), samples(k), samples(v), samples(kp), strict=True)]  # fmt: skip
        torch.testing.assert_close(out.values, torch.cat(want))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the torch.nested branch runs on CUDA only"
)
def test_cuda_plain_attention_takes_torch_nested_and_equals_per_sample_sdpa():
    q, k, v = (packed(DISTINCT[0], seed, dtype=torch.float32) for seed in range(3))
    q, k, v = (raggedfn.Ragged(t.values.cuda(), t.offsets.cuda(), t.sizes.cuda(), t.layout) for t in (q, k, v))  # fmt: skip
    with spy(_attention, "_nested_cuda") as nested:
        out = raggedfn.attention(q, k, v, causal=True, scale=0.7)
    assert nested
    want = [sdpa_sample(a, b, c, causal=True, scale=0.7) for a, b, c in zip(samples(q), samples(k), samples(v), strict=True)]  # fmt: skip
    torch.testing.assert_close(out.values, torch.cat(want), rtol=2e-3, atol=2e-3)


# ----- products ---------------------------------------------------------------------------

PRODUCT_PATHS = {
    # path: (spied module, function, batch lengths)
    "packed": (_products, "_packed", [3, 0, 2, 4, 1, 2]),
    "per_sample": (_products, "_per_sample", [3, 0, 2, 4]),
    "buckets": (_bucket, "plan", [3, 0, 2, 4, 1, 2]),
}
EQUATIONS = {
    "packed": ["bnd,de->bne"],
    "per_sample": ["bnd,bmd->bnm", "bnm,bmd->bnd", "bnd,bne->bde", "bnd,bd->bn"],
    "buckets": ["bnd,bmd->bnm", "bnm,bmd->bnd", "bnd,bne->bde", "bnd,bd->bn"],
}


def einsum_loop(equation: str, operands: list[Any]) -> list[torch.Tensor]:
    inputs, rhs = equation.split("->")
    subs = inputs.split(",")
    batch = next(op.batch_size for op in operands if isinstance(op, Ragged))
    cut = [samples(op) if isinstance(op, Ragged) else op for op in operands]
    text = ",".join(s[1:] if (isinstance(op, Ragged) or s[0] == rhs[0]) else s for s, op in zip(subs, operands, strict=True)) + "->" + rhs[1:]  # fmt: skip
    outs = []
    for b in range(batch):
        args = [
            c[b] if isinstance(op, Ragged) else (op[b] if s[0] == rhs[0] else op)
            for c, op, s in zip(cut, operands, subs, strict=True)
        ]
        outs.append(torch.einsum(text, *args))
    return outs


def product_operands(equation: str, lengths: list[int]) -> list[Any]:
    gen = torch.Generator().manual_seed(11)
    inputs = equation.split("->")[0].split(",")
    ops: list[Any] = []
    square = torch.tensor([[n, n] for n in lengths], dtype=torch.int64)
    for sub in inputs:
        if sub == "bnd" or sub == "bmd":
            values = torch.randn(sum(lengths), 4, generator=gen, dtype=torch.float64)
            ops.append(raggedfn.from_lengths(values, torch.tensor(lengths)))
        elif sub == "bnm":
            values = torch.randn(sum(n * n for n in lengths), generator=gen, dtype=torch.float64)
            ops.append(raggedfn.from_sizes(values, square))
        elif sub == "bne":
            values = torch.randn(sum(lengths), 3, generator=gen, dtype=torch.float64)
            ops.append(raggedfn.from_lengths(values, torch.tensor(lengths)))
        elif sub == "bd":
            ops.append(torch.randn(len(lengths), 4, generator=gen, dtype=torch.float64))
        else:  # "de": a weight shared by all samples
            ops.append(torch.randn(4, 5, generator=gen, dtype=torch.float64))
    return ops


@pytest.mark.parametrize(
    ("path", "equation"), [(p, e) for p, eqs in EQUATIONS.items() for e in eqs]
)
def test_product_path_equals_per_sample_einsum(path, equation, monkeypatch):
    module, name, lengths = PRODUCT_PATHS[path]
    if path == "buckets":
        monkeypatch.setattr(_products, "PER_SAMPLE_MAX_BATCH", 0)
        monkeypatch.setattr(_products, "PER_SAMPLE_MIN_WORK", float("inf"))
    else:
        monkeypatch.setattr(_products, "PER_SAMPLE_MAX_BATCH", len(lengths))
    operands = product_operands(equation, lengths)
    leaves = []
    for op in operands:
        t = op.values if isinstance(op, Ragged) else op
        t.requires_grad_(True)
        leaves.append(t)
    with spy(module, name) as calls:
        out = raggedfn.einsum(equation, *operands)
    assert calls, f"einsum did not take the {path} path"
    want = einsum_loop(equation, operands)
    got = samples(out) if isinstance(out, Ragged) else list(out.unbind(0))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    values = out.values if isinstance(out, Ragged) else out
    gen = torch.Generator().manual_seed(5)
    cot = torch.randn(values.shape, generator=gen, dtype=torch.float64)
    mine = torch.autograd.grad(values, leaves, cot, allow_unused=True, materialize_grads=True)
    flat = torch.cat([w.reshape(-1, *values.shape[1:]) for w in want]) if isinstance(out, Ragged) else torch.stack(want)  # fmt: skip
    theirs = torch.autograd.grad(flat, leaves, cot, allow_unused=True, materialize_grads=True)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b)
