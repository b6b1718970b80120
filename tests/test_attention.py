"""attention: both implementations, errors, gradcheck, masking policy; compiled Pairformer block."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

import raggedfn
from benchmarks import pairformer
from property_tests._pairs_helpers import tight_buckets
from property_tests.reference import assert_same, samples
from property_tests.test_attention_props import sdpa_sample
from raggedfn import Ragged, RaggedError
from raggedfn.ops import _attention

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def tokens(lengths, heads=2, dim=3, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), heads, dim, generator=gen, dtype=dtype)
    return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def pair_bias(n_lengths, m_lengths, heads=2, dtype=torch.float64, seed=9):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(list(zip(n_lengths, m_lengths, strict=True)), dtype=torch.int64)
    count = sum(n * m for n, m in zip(n_lengths, m_lengths, strict=True))
    return raggedfn.from_sizes(torch.randn(count, heads, generator=gen, dtype=dtype), sizes)


def test_bucketed_path_for_large_batches_matches_per_sample_sdpa():
    lengths = [int(n) for n in torch.randint(0, 30, (_attention.LOOP_MAX_BATCH + 6,))]
    q = tokens(lengths, dtype=torch.float32)
    k = tokens(lengths, dtype=torch.float32, seed=1)
    keys = raggedfn.from_lengths(torch.rand(sum(lengths)) < 0.3, lengths)
    out = raggedfn.attention(q, k, k, key_padding=keys, causal=True)
    expected = [
        sdpa_sample(a, b, b, key_padding=p, causal=True)
        for a, b, p in zip(samples(q), samples(k), samples(keys), strict=True)
    ]
    assert_same(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bucketed", [False, True])
def test_gradcheck_and_gradgradcheck_float64(bucketed):
    q, k, v = tokens([2, 0, 3]), tokens([3, 1, 2], seed=1), tokens([3, 1, 2], seed=2)
    bias = pair_bias([2, 0, 3], [3, 1, 2])
    keys = raggedfn.from_lengths(torch.tensor([False, True, False, True, False, False]), [3, 1, 2])

    def f(qv, kv, vv, bv):
        out = raggedfn.attention(
            q.with_values(qv),
            k.with_values(kv),
            v.with_values(vv),
            bias=bias.with_values(bv),
            key_padding=keys,
            causal=True,
        )
        return out.values

    args = tuple(t.values.clone().requires_grad_(True) for t in (q, k, v, bias))
    if bucketed:
        with tight_buckets():
            assert torch.autograd.gradcheck(f, args)
            assert torch.autograd.gradgradcheck(f, args)
    else:
        assert torch.autograd.gradcheck(f, args)
        assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("bucketed", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_grads(bucketed):
    q = tokens([2, 2])
    k = tokens([3, 0], seed=1)
    keys = raggedfn.from_lengths(torch.tensor([True, True, True]), [3, 0])  # all keys ignored
    values = k.values.clone().requires_grad_(True)
    if bucketed:
        with tight_buckets():
            out = raggedfn.attention(q, k.with_values(values), k, key_padding=keys)
    else:
        out = raggedfn.attention(q, k.with_values(values), k, key_padding=keys)
    assert torch.equal(out.values, torch.zeros_like(out.values))
    (grad,) = torch.autograd.grad(out.values.sum(), values)
    assert torch.isfinite(grad).all()


def test_inputs_are_not_mutated():
    q, k = tokens([2, 3]), tokens([1, 4], seed=1)
    bias = pair_bias([2, 3], [1, 4])
    before = [t.values._version for t in (q, k, bias)]
    raggedfn.attention(q, k, k, bias=bias, causal=True)
    with tight_buckets():
        raggedfn.attention(q, k, k, bias=bias, causal=True)
    assert [t.values._version for t in (q, k, bias)] == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"q": "q"}, "q must be a Ragged value, got str"),
        ({"k": tokens([2, 3, 1])}, "q, k and v must have the same batch size, got 2, 3 and 2"),
        ({"k": tokens([2, 3], dim=4)}, "disagree"),
        ({"v": tokens([1, 1])}, "k and v must have the same partition"),
        ({"bias": torch.ones(2, 5, 5)}, r"a dense bias must have shape \(\.\.\., H or 1, 1, 1\)"),
        (
            {"bias": pair_bias([2, 3], [2, 2])},
            r"bias sizes \[\[2, 2\], \[3, 2\]\] must be \(N_i, M_i\)",
        ),
        ({"key_padding": tokens([2, 3])}, "key_padding must be a boolean Ragged value"),
        ({"causal": 1}, "causal must be a bool, got int 1"),
    ],
)
def test_errors(kwargs, message):
    q = tokens([2, 3])
    args = {"q": q, "k": q, "v": q, **kwargs}
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(RaggedError, match=message):
        raggedfn.attention(q, k, v, **args)


# ----- torch.compile: a Pairformer-style block ---------------------------------------------

CHANNELS = 20  # 4 heads of 5; distinct from every B + 1 and T below (no duck sizing)
LENGTHS = [[3, 5], [2, 6, 4], [7, 1, 3], [4, 4, 4], [5, 2, 6, 3], [6, 3]]


def pair_batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([[n, n] for n in lengths], dtype=torch.int64)
    values = torch.randn(sum(n * n for n in lengths), CHANNELS, generator=gen)
    return raggedfn.from_sizes(values, sizes)


def test_compiled_pairformer_block_is_one_graph_equal_to_eager():
    """The whole block (triangle products, triangle attention, transition) under inductor with
    ``fullgraph=True``: products and attention are opaque host-planned nodes, so new lengths
    and batch sizes reuse the one graph, forward and backward."""
    params = pairformer.make_params(0, channels=CHANNELS, blocks=1)

    def loss(z):
        return (pairformer.ragged_model(z, params).values ** 2).sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, fullgraph=True)
    for n, lengths in enumerate([*LENGTHS, [0, 9, 2, 1, 1, 5]]):
        z = pair_batch(lengths, n)
        leaf = z.values.clone().requires_grad_(True)
        z_leaf = z.with_values(leaf)
        raggedfn.mark_dynamic(z_leaf)
        got = compiled(z_leaf)
        (got_grad,) = torch.autograd.grad(got, leaf)
        leaf2 = z.values.clone().requires_grad_(True)
        want = loss(z.with_values(leaf2))
        (want_grad,) = torch.autograd.grad(want, leaf2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_dense_parts_of_the_block_compile_fullgraph():
    params = pairformer.make_params(1, channels=CHANNELS, blocks=1)[0]
    weight = torch.randn(CHANNELS, CHANNELS)

    def dense_part(z: Ragged) -> Ragged:
        return raggedfn.matmul(pairformer.ragged_transition(z, params), weight)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(dense_part, fullgraph=True)
    for n, lengths in enumerate(LENGTHS):
        z = pair_batch(lengths, 10 + n)
        torch.testing.assert_close(compiled(z).values, dense_part(z).values, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m"), [(4, 4), (2, 5), (5, 2)])
def test_equal_lengths_take_one_dense_call_and_match_per_sample_sdpa(causal, n, m):
    """All samples of one length: the fast path on views of the packed values."""
    gen = torch.Generator().manual_seed(n * 10 + m)
    batch, heads, dim = 3, 2, 3
    qv = torch.randn(batch * n, heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(batch * m, heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    vv = torch.randn(
        batch * m, heads, dim + 1, generator=gen, dtype=torch.float64, requires_grad=True
    )

    def ragged(qv, kv, vv):
        q = raggedfn.from_lengths(qv, [n] * batch)
        k = raggedfn.from_lengths(kv, [m] * batch)
        v = raggedfn.from_lengths(vv, [m] * batch)
        return raggedfn.attention(q, k, v, causal=causal).values

    def loop(qv, kv, vv):
        outs = []
        for b in range(batch):
            q, k, v = (
                t[b * s : (b + 1) * s].transpose(0, 1) for t, s in ((qv, n), (kv, m), (vv, m))
            )
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(0, 1))
        return torch.cat(outs)

    got, want = ragged(qv, kv, vv), loop(qv, kv, vv)
    torch.testing.assert_close(got, want)
    weights = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad((got * weights).sum(), (qv, kv, vv))
    want_grads = torch.autograd.grad((want * weights).sum(), (qv, kv, vv))
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    assert torch.autograd.gradcheck(ragged, (qv, kv, vv))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stored", ["standard", "dh_before_h"])
def test_small_batch_tokens_take_views_and_equal_per_sample_sdpa(causal, stored, monkeypatch):
    """B <= LOOP_MAX_BATCH, distinct lengths, no bias/padding: SDPA per sample on strided
    views of the packed values (q, k, v slices of one fused tensor, any dense storage order),
    equal to the copying per-sample path exactly and to SDPA per sample in gradients."""
    n_lengths, m_lengths = [3, 0, 5, 2, 1], [4, 2, 5, 0, 1]
    heads, dim = 2, 3
    gen = torch.Generator().manual_seed(5)
    qv = torch.randn(sum(n_lengths), 2, heads, dim, generator=gen, dtype=torch.float64)
    kv = torch.randn(sum(m_lengths), 2, heads, dim, generator=gen, dtype=torch.float64)
    qv.requires_grad_(True)
    kv.requires_grad_(True)

    def ragged(values, lengths, j):
        x = values[:, j]  # strided: a slice of the fused tensor
        if stored == "dh_before_h":  # stored (Dh, H), logical (H, Dh): a non-standard layout
            x = x.transpose(1, 2).contiguous()
            return raggedfn.transpose(raggedfn.from_lengths(x, n_lengths_of(lengths)), -1, -2)
        return raggedfn.from_lengths(x, n_lengths_of(lengths))

    def n_lengths_of(lengths):
        return torch.tensor(lengths, dtype=torch.int64)

    q, k, v = ragged(qv, n_lengths, 0), ragged(kv, m_lengths, 0), ragged(kv, m_lengths, 1)
    assert (stored == "standard") == (q.layout == raggedfn.Layout.standard(1, 2))
    copying = _attention._per_sample(q, k, v, None, None, causal, None)

    def no_copies(*args, **kwargs):
        raise AssertionError("took the copying per-sample path")

    monkeypatch.setattr(_attention, "_per_sample", no_copies)
    out = raggedfn.attention(q, k, v, causal=causal)
    assert out.shape == q.shape and out.layout == q.layout
    assert torch.equal(out.values, copying.values)
    expected = [
        sdpa_sample(a, b, c, causal=causal)
        for a, b, c in zip(samples(q), samples(k), samples(v), strict=True)
    ]
    assert_same(out, expected)
    weights = torch.randn(out.values.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out.values * weights).sum(), (qv, kv))
    want = torch.autograd.grad((copying.values * weights).sum(), (qv, kv))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)

    def f(qv, kv):
        a, b, c = ragged(qv, n_lengths, 0), ragged(kv, m_lengths, 0), ragged(kv, m_lengths, 1)
        return raggedfn.attention(a, b, c, causal=causal).values

    # (no gradgradcheck: torch's fused CPU SDPA, on either path, has no double backward)
    assert torch.autograd.gradcheck(f, (qv, kv))


@pytest.mark.parametrize("heavy", [False, True])
def test_large_batch_chooses_views_or_buckets_by_work_per_sample(heavy, monkeypatch):
    """B > LOOP_MAX_BATCH: per-sample views where a sample's mean work reaches
    VIEWS_MIN_WORK, buckets below it; both equal SDPA run on each sample alone."""
    lengths = [1 + (7 * b) % 9 for b in range(_attention.LOOP_MAX_BATCH + 6)]
    q = tokens(lengths, dtype=torch.float32)
    k = tokens(lengths, dtype=torch.float32, seed=1)
    work = 2 * (3 + 3) * sum(n * n for n in lengths) // len(lengths)  # H (Dh + Dv) N M
    monkeypatch.setattr(_attention, "VIEWS_MIN_WORK", work if heavy else work + 1)
    taken = []
    views = _attention._per_sample_views
    monkeypatch.setattr(
        _attention, "_per_sample_views", lambda *args: taken.append(1) or views(*args)
    )
    out = raggedfn.attention(q, k, k, causal=True)
    assert taken == ([1] if heavy else [])
    expected = [
        sdpa_sample(a, b, b, causal=True) for a, b in zip(samples(q), samples(k), strict=True)
    ]
    assert_same(out, expected, rtol=1e-5, atol=1e-5)


def test_equal_lengths_with_strided_head_dim_equal_contiguous_input():
    """The one-call path keeps views of unit-stride Dh and copies only other strides."""
    gen = torch.Generator().manual_seed(3)
    stored = torch.randn(12, 3, 2, generator=gen, dtype=torch.float64)  # [T, Dh, H]
    strided = stored.transpose(1, 2)  # [T, H, Dh], Dh stride 2: a standard layout all the same
    q = raggedfn.from_lengths(strided, [4, 4, 4])
    assert q.layout == raggedfn.Layout.standard(1, 2) and q.values.stride(-1) != 1
    dense = raggedfn.from_lengths(strided.contiguous(), [4, 4, 4])
    out = raggedfn.attention(q, q, q)
    assert torch.equal(out.values, raggedfn.attention(dense, dense, dense).values)
    assert_same(out, [sdpa_sample(a, a, a) for a in samples(q)])


# ----- a bias that needs a gradient: the lean primitive instead of torch's math path --------


def _triangle(lengths, heads=2, dim=2, seed=0):
    """q, k, v (B, I*, N*, H, Dh) and a pair bias (B, N*, N*, H), all with I = N."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([[n, n] for n in lengths], dtype=torch.int64)
    count = sum(n * n for n in lengths)

    def state(*dense):
        values = torch.randn(count, *dense, generator=gen, dtype=torch.float64)
        return raggedfn.from_sizes(values.requires_grad_(True), sizes)

    return state(heads, dim), state(heads, dim), state(heads, dim), state(heads)


def _saved_numels(fn):
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, numels


@pytest.mark.parametrize("bucketed", [False, True])
def test_pair_bias_gradient_keeps_no_softmax_and_matches_per_sample_sdpa(bucketed):
    """Triangle attention with a pair bias that needs a gradient: autograd keeps no
    [rows, H, N, M] softmax (torch's SDPA math path would), values and gradients as SDPA."""
    lengths, heads = [8, 3], 2
    q, k, v, bias = _triangle(lengths, heads)
    softmax = lengths[0] * heads * lengths[0] * lengths[0]  # rows x H x N x M of sample 0
    with tight_buckets() if bucketed else torch.enable_grad():
        out, numels = _saved_numels(lambda: raggedfn.attention(q, k, v, bias=bias))
    assert max(numels) < softmax, (max(numels), softmax)
    # the same inputs through torch's SDPA, one row of one sample at a time
    leaves = [t.values for t in (q, k, v, bias)]
    cotangent = torch.randn(out.values.shape, dtype=torch.float64)
    got = torch.autograd.grad(out.values, leaves, cotangent)
    rows = [
        sdpa_sample(qs[i], ks[i], vs[i], b)
        for qs, ks, vs, b in zip(*(samples(t) for t in (q, k, v, bias)), strict=True)
        for i in range(qs.shape[0])
    ]
    want_values = torch.cat([r.reshape(-1, *r.shape[1:]) for r in rows])
    torch.testing.assert_close(out.values, want_values)
    want = torch.autograd.grad(want_values, leaves, cotangent)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("bias_grad", [False, True])
@pytest.mark.parametrize("bucketed", [False, True])
def test_dense_head_bias_on_many_rows_in_chunks(bucketed, bias_grad, monkeypatch):
    """A dense (H, 1, 1) bias on triangle rows cut into one-row SDPA calls: every chunk
    sees every head (the bias has no row axis to cut), with and without a bias gradient."""
    monkeypatch.setattr(_attention, "CHUNK_LOGITS", 1)
    lengths, heads = [5, 3], 2
    q, k, v, _ = _triangle(lengths, heads, seed=1)
    head_bias = torch.randn(heads, 1, 1, dtype=torch.float64).requires_grad_(bias_grad)
    with tight_buckets() if bucketed else torch.enable_grad():
        out = raggedfn.attention(q, k, v, bias=head_bias)
    rows = [
        sdpa_sample(qs[i], ks[i], vs[i], head_bias.permute(1, 2, 0).expand(n, n, heads))
        for qs, ks, vs, n in zip(*(samples(t) for t in (q, k, v)), lengths, strict=True)
        for i in range(n)
    ]
    want_values = torch.cat(rows)
    torch.testing.assert_close(out.values, want_values)
    leaves = [q.values, k.values, v.values] + ([head_bias] if bias_grad else [])
    cotangent = torch.randn(out.values.shape, dtype=torch.float64)
    got = torch.autograd.grad(out.values, leaves, cotangent)
    want = torch.autograd.grad(want_values, leaves, cotangent)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("bucketed", [False, True])
def test_dense_bias_gradient_with_key_padding_and_causal(bucketed):
    """A per-sample dense bias (B, H, 1, 1) that needs a gradient, with masks on top."""
    lengths = [4, 0, 6, 2]
    q, k, v = (tokens(lengths, seed=s) for s in range(3))
    q, k, v = (x.with_values(x.values.requires_grad_(True)) for x in (q, k, v))
    bias = torch.randn(4, 2, 1, 1, dtype=torch.float64, requires_grad=True)
    flags = torch.tensor(
        [False, True, False, False, True, False, False, False, False, False, True, False]
    )
    keys = raggedfn.from_lengths(flags, lengths)
    with tight_buckets() if bucketed else torch.enable_grad():
        out = raggedfn.attention(q, k, v, bias=bias, key_padding=keys, causal=True)
    per_sample = [
        sdpa_sample(a, b, c, bias[i].permute(1, 2, 0).expand(n, n, 2), p, causal=True)
        for i, (a, b, c, p, n) in enumerate(
            zip(samples(q), samples(k), samples(v), samples(keys), lengths, strict=True)
        )
    ]
    want_values = torch.cat(per_sample)
    torch.testing.assert_close(out.values, want_values)
    leaves = [q.values, k.values, v.values, bias]
    cotangent = torch.randn(out.values.shape, dtype=torch.float64)
    got = torch.autograd.grad(out.values, leaves, cotangent)
    want = torch.autograd.grad(want_values, leaves, cotangent)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_per_sample_views_backward_records_views_only_around_each_call(monkeypatch):
    """The views path joins its per-sample outputs through views (no select, whose
    backward zero-fills a gradient per sample) and still equals SDPA per sample."""
    taken = []
    views = _attention._per_sample_views
    monkeypatch.setattr(
        _attention, "_per_sample_views", lambda *args: taken.append(1) or views(*args)
    )
    lengths = [3, 1, 4]
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 2, 4, generator=gen, dtype=torch.float64)
    qkv.requires_grad_(True)
    x = raggedfn.from_lengths(torch.zeros(sum(lengths), 8), torch.tensor(lengths))
    q, k, v = (x.with_values(t) for t in qkv.unbind(1))
    out = raggedfn.attention(q, k, v)
    assert taken == [1]
    seen, stack = set(), [out.values.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    names = {type(n).__name__ for n in seen}
    assert sum("ScaledDotProduct" in n for n in names) == 1
    assert "SelectBackward0" not in names, names
    weights = torch.randn(out.values.shape, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad((out.values * weights).sum(), qkv)
    parts = qkv.detach().clone().requires_grad_(True)
    want = []
    for piece in parts.split(lengths):
        a, b, c = (t.transpose(0, 1)[None] for t in piece.unbind(1))  # [1, H, N, Dh]
        want.append(F.scaled_dot_product_attention(a, b, c)[0].transpose(0, 1))
    torch.testing.assert_close(out.values, torch.cat(want), rtol=0, atol=0)
    (expected,) = torch.autograd.grad((torch.cat(want) * weights).sum(), parts)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_sizes_are_read_on_the_host_once_per_partition(monkeypatch):
    """Attention plans on the host sizes; q, k and v of one partition, and every later
    call on it, reuse one read (a device sync on accelerators)."""
    lengths = [3, 1, 4]
    gen = torch.Generator().manual_seed(4)
    x = raggedfn.from_lengths(torch.zeros(sum(lengths), 8), torch.tensor(lengths))
    reads = []
    tolist = torch.Tensor.tolist

    def spy(self):
        reads.append(tuple(self.shape))
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    outs, qkvs = [], []
    for _ in range(3):
        qkv = torch.randn(sum(lengths), 3, 2, 4, generator=gen)
        q, k, v = (x.with_values(t) for t in qkv.unbind(1))
        outs.append(raggedfn.attention(q, k, v))
        qkvs.append(qkv)
    assert reads == [(3, 1)]
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    for out, qkv in zip(outs, qkvs, strict=True):
        want = [
            F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in p.unbind(1)))[0]
            for p in qkv.split(lengths)
        ]
        torch.testing.assert_close(out.values, torch.cat([w.transpose(0, 1) for w in want]))


def _masked_attention_inputs(
    n_lengths: list[int], m_lengths: list[int], mask_kind: str, heads: int = 2
) -> tuple[list[torch.Tensor], list[raggedfn.Ragged], list[torch.Tensor]]:
    """Leaves of q, k, v (requiring grad), the three ragged values over them, and each
    sample's mask ``[N, M, h]`` (``mask_kind`` "none": no masks)."""
    q = tokens(n_lengths, heads=heads, seed=1)
    k = tokens(m_lengths, heads=heads, seed=2)
    v = tokens(m_lengths, heads=heads, dim=4, seed=3)
    gen = torch.Generator().manual_seed(4)
    masks = []
    for n, m in zip(n_lengths, m_lengths, strict=True):
        if mask_kind == "boolean":  # every query keeps its first key: no row is all masked
            keep = torch.rand(n, m, 1, generator=gen) > 0.4
            masks.append(keep | (torch.arange(m) == 0)[None, :, None])
        elif mask_kind != "none":
            masks.append(torch.randn(n, m, heads, generator=gen, dtype=torch.float64))
    leaves = [t.values.detach().requires_grad_() for t in (q, k, v)]
    qkv = [t.with_values(leaf) for t, leaf in zip((q, k, v), leaves, strict=True)]
    return leaves, qkv, masks


def _assert_each_samples_sdpa(
    got: raggedfn.Ragged,
    leaves: list[torch.Tensor],
    qkv: list[raggedfn.Ragged],
    masks: list[torch.Tensor],
    rank: int,
    causal: bool,
) -> None:
    """``got`` equals, in values and gradients, one ``scaled_dot_product_attention`` call
    per sample with that sample's mask (and the top-left causal triangle), at ``rank``."""
    q, k, v = qkv
    want = []
    for i in range(q.batch_size):
        qi, ki, vi = (t[i].transpose(0, 1) for t in (q, k, v))  # [H, N, D]
        mi = masks[i].movedim(-1, 0) if masks else None  # [h, N, M]
        if causal:
            lower = torch.ones(qi.shape[-2], ki.shape[-2], dtype=torch.bool).tril()
            mi = mi & lower if mi.dtype == torch.bool else mi.masked_fill(~lower, -float("inf"))
        if rank == 4:
            qi, ki, vi = qi[None], ki[None], vi[None]
            mi = None if mi is None else mi[None]
        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mi, scale=0.7)
        want.append((out[0] if rank == 4 else out).transpose(0, 1))
    assert_same(got, want, rtol=1e-12, atol=1e-12)
    weight = torch.randn_like(got.values)
    grads = torch.autograd.grad((got.values * weight).sum(), leaves)
    lengths = [w.shape[0] for w in want]
    loss = sum((w * o).sum() for w, o in zip(weight.split(lengths), want, strict=True))
    want_grads = torch.autograd.grad(loss, leaves)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("mask_kind", ["boolean", "additive per head", "none"])
def test_attention_with_a_mask_per_pair_equals_each_samples_sdpa_call(rank, mask_kind):
    """``attention_with_mask`` (the path ``map`` takes for an ``attn_mask``) on a small
    batch (one call per sample) equals the per-sample ``scaled_dot_product_attention``
    with that sample's mask, at the rank the sample's call had, values and gradients."""
    from raggedfn.ops._attention_masked import attention_with_mask

    leaves, qkv, masks = _masked_attention_inputs([3, 0, 5, 2], [4, 2, 5, 1], mask_kind)
    mask = raggedfn.from_list(masks, ragged_dims=(1, 2)) if masks else None
    got = attention_with_mask(*qkv, mask, False, 0.7, 0.0, rank)
    _assert_each_samples_sdpa(got, leaves, qkv, masks, rank, causal=False)


@pytest.mark.parametrize(
    "extra", [(3,), (1, 1), (2, 1)], ids=["3 heads of 2", "rank 4 width 1", "rank 4 width H"]
)
def test_attention_with_mask_refuses_a_mask_of_another_shape(extra):
    """The mask is a pair state ``(B, N*, M*, h)`` with ``h`` 1 or H: a width that is
    neither, or one more dense axis (whatever its first size), is refused by name."""
    from raggedfn.ops._attention_masked import attention_with_mask

    n_lengths, m_lengths = [3, 1], [2, 4]
    q, k = tokens(n_lengths, heads=2, seed=1), tokens(m_lengths, heads=2, seed=2)
    mask = raggedfn.from_list(
        [
            torch.ones(n, m, *extra, dtype=torch.bool)
            for n, m in zip(n_lengths, m_lengths, strict=True)
        ],
        ragged_dims=(1, 2),
    )
    with pytest.raises(
        RaggedError, match=r"^attention: the mask must be a pair state \(B, N\*, M\*, 1 or H\)"
    ):
        attention_with_mask(q, k, k, mask, False, None, 0.0, 4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("mask_kind", ["boolean", "additive per head"])
def test_attention_with_a_mask_per_pair_in_length_buckets_equals_each_samples_sdpa(
    mask_kind, rank, causal, monkeypatch
):
    """A batch above ``LOOP_MAX_BATCH`` of light samples: ``attention_with_mask`` runs
    length buckets (``_buckets``, spied), several samples to a bucket, the mask scattered
    into each box; values and gradients equal the per-sample SDPA call with that sample's
    mask (and the top-left causal triangle), at the sample's rank."""
    from raggedfn.ops import _attention_masked

    monkeypatch.setattr(_attention_masked, "LOOP_MAX_BATCH", 2)
    calls = []
    real = _attention_masked._buckets
    monkeypatch.setattr(_attention_masked, "_buckets", lambda *a: calls.append(1) or real(*a))
    groups = []  # samples per bucket
    plan = _attention_masked._bucket.plan
    monkeypatch.setattr(
        _attention_masked._bucket,
        "plan",
        lambda *a: groups.extend(len(b.samples) for b in plan(*a)) or plan(*a),
    )
    leaves, qkv, masks = _masked_attention_inputs(
        [3, 0, 5, 2, 3, 5, 1], [4, 2, 5, 1, 4, 3, 2], mask_kind
    )
    mask = raggedfn.from_list(masks, ragged_dims=(1, 2))
    with tight_buckets():
        got = _attention_masked.attention_with_mask(*qkv, mask, causal, 0.7, 0.0, rank)
    assert calls and max(groups) > 1
    _assert_each_samples_sdpa(got, leaves, qkv, masks, rank, causal)
