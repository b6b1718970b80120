"""raggedfn.map: equal to the per-sample loop, fallbacks, reports, models, composition."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from property_tests.reference import assert_same, loop, pack_like, samples
from raggedfn import RaggedError, RaggedPerformanceWarning

D = 8


def tokens(lengths, dim=D, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list([torch.randn(n, dim, generator=gen, dtype=dtype) for n in lengths])


def pairs(lengths, channels=3, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, n, channels, generator=gen, dtype=dtype) for n in lengths],
        ragged_dims=(1, 2),
    )


def weights(*shape, seed=2, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


W = weights(6, D)
W43 = weights(4, 3)
LENGTHS = (3, 0, 5, 1, 4)

# per-sample functions of a token sample t: (N, D) and a shared weight w: (6, D)
TOKEN_FUNCTIONS = {
    "linear_relu": lambda t, w: F.linear(t, w).relu(),
    "matmul_softmax_sum": lambda t, w: (t @ w.T).softmax(0).sum(0),
    "log_softmax_dense": lambda t, w: F.log_softmax(t, -1),
    "pair_outer_sum": lambda t, w: (t[:, None, :] + t[None, :, :]).sum(-1),
    "attention_sdpa": lambda t, w: F.scaled_dot_product_attention(t[None], t[None], t[None])[0],
    "attention_causal": lambda t, w: F.scaled_dot_product_attention(
        t[None], t[None], t[None], is_causal=True
    )[0],
    "cat_constant_row": lambda t, w: torch.cat([w[:1, :D], t], 0),
    "cat_dense_axis": lambda t, w: torch.cat([t, t * 2], -1),
    "stack": lambda t, w: torch.stack([t, t.exp()], 0),
    "layer_norm": lambda t, w: F.layer_norm(t, (D,)),
    "rms_norm": lambda t, w: F.rms_norm(t, (D,)),
    "mean_ragged": lambda t, w: t.mean(0),
    "sum_all": lambda t, w: t.sum(),
    "logsumexp_ragged": lambda t, w: t.logsumexp(0),
    "norm_ragged": lambda t, w: torch.linalg.vector_norm(t, dim=0),
    "attn_by_hand": lambda t, w: torch.softmax(t @ t.T / math.sqrt(D), -1) @ t,
    "gram": lambda t, w: t.T @ t,
    "cumsum_ragged": lambda t, w: t.cumsum(0),
    "arange_weights": lambda t, w: t * torch.arange(t.shape[0], dtype=t.dtype)[:, None],
    "slice_ragged": lambda t, w: t[1:] - t[:-1],
    "transpose_reduce": lambda t, w: t.T.sum(-1, keepdim=True),
    "where_masked_fill": lambda t, w: torch.where(t > 0, t, -t).masked_fill(t < -1, 0.5),
    "size_as_scalar": lambda t, w: t / (t.shape[0] + 1),
    "zeros_like_ones": lambda t, w: torch.zeros_like(t) + torch.ones(t.shape[0], 1, dtype=t.dtype),
    "expand_reshape": lambda t, w: t[:, None, :].expand(-1, 2, -1).reshape(t.shape[0], 2 * D),
    "select_dense": lambda t, w: t[:, 0] * t[:, 1],
    "dropout_eval": lambda t, w: F.dropout(t, 0.5, training=False),
    "gelu_silu": lambda t, w: F.gelu(t) + F.silu(t),
}


@pytest.mark.parametrize("name", sorted(TOKEN_FUNCTIONS))
def test_token_functions_equal_the_loop(name):
    f = TOKEN_FUNCTIONS[name]
    x = tokens(LENGTHS)
    report = raggedfn.map_report(f, x, W, in_dims=(0, None))
    assert_same(report.output, loop(f, x, W))
    assert report.fully_batched, str(report)


def test_reductions_of_nonempty_samples():
    x = tokens((3, 2, 5))
    for f in (
        lambda t: t.amax(0),
        lambda t: t.amin(0),
        lambda t: t.argmax(0),
        lambda t: t.argmin(0),
        lambda t: t.std(0, correction=0),
        lambda t: t.var(0),
        lambda t: t.prod(0),
    ):
        report = raggedfn.map_report(f, x)
        assert_same(report.output, loop(f, x))
        assert report.fully_batched, str(report)


@pytest.mark.parametrize("f", [lambda t: t.amax(0), lambda t: t.argmax(0)])
def test_empty_samples_raise_where_the_loop_raises(f):
    # torch refuses amax/argmax over an empty axis: so does map, with torch's own
    # IndexError and a note naming the sample, while other batches still run batched
    x = tokens((2, 0, 3))
    with pytest.raises(IndexError) as want:
        loop(f, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        with pytest.raises(IndexError, match="non-zero size") as error:
            raggedfn.map(f, x)
    assert str(error.value) == str(want.value)
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]
    assert_same(raggedfn.map(f, tokens((2, 3))), loop(f, tokens((2, 3))))


@pytest.mark.parametrize(
    "f",
    [
        lambda p: p.softmax(1).sum(1),
        lambda p: p + p.transpose(0, 1),
        lambda p: p.mean((0, 1)),
        lambda p: F.linear(p, W43).relu().sum(0),
        lambda p: p.permute(1, 0, 2).cumsum(0),
        lambda p: p[:, :, 0] @ p[:, :, 1],
    ],
)
def test_pair_state_functions_equal_the_loop(f):
    x = pairs((3, 0, 2, 1))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_several_arguments_dense_mapped_and_pytree_outputs():
    x = tokens(LENGTHS)
    scale = weights(len(LENGTHS), D, seed=5)
    shared = {"w": W, "b": weights(6, seed=6)}

    def f(t, s, p):
        h = F.linear(t * s, p["w"], p["b"])
        return {"tokens": h, "pooled": h.mean(0), "const": p["b"] * 2, "n": t.shape[0]}

    out = raggedfn.map(f, x, scale, shared, in_dims=(0, 0, None))
    expected = [f(t, s, shared) for t, s in zip(samples(x), scale, strict=True)]
    assert_same(out["tokens"], [e["tokens"] for e in expected])
    assert_same(out["pooled"], [e["pooled"] for e in expected])
    assert_same(out["const"], [e["const"] for e in expected])
    assert out["n"].tolist() == list(LENGTHS)


def test_inputs_are_not_mutated():
    x = tokens(LENGTHS)
    version = x.values._version
    raggedfn.map(lambda t: F.layer_norm(t, (D,)).softmax(0), x)
    assert x.values._version == version


def test_float32_inputs():
    x = tokens(LENGTHS, dtype=torch.float32)
    f = TOKEN_FUNCTIONS["attn_by_hand"]
    assert_same(raggedfn.map(f, x, W.float(), in_dims=(0, None)), loop(f, x, W.float()))


# ----- fallback, guards, strict -------------------------------------------------------


def flip_then_sum(t):
    return torch.flip(t, [0]).cumsum(0) * 2


def test_op_without_rule_runs_per_sample_and_is_reported():
    x = tokens(LENGTHS)
    report = raggedfn.map_report(flip_then_sum, x)
    assert_same(report.output, loop(flip_then_sum, x))
    assert "aten.flip.default" in report.fallback
    assert not report.fully_batched
    assert "aten.cumsum.default" in report.batched
    assert "aten.flip.default" in str(report)


def test_a_fallback_warns_once_per_op_and_signature():
    def f(t):
        return torch.flip(t, [0]) * 3

    x = tokens(LENGTHS)
    with pytest.warns(RaggedPerformanceWarning, match=r"aten\.flip\.default runs as a per-sample"):
        assert_same(raggedfn.map(f, x), loop(f, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(raggedfn.map(f, x), loop(f, x))  # the same signature: no second warning


def test_strict_names_the_op_without_rule():
    with pytest.raises(RaggedError, match=r"map: op aten\.flip\.default has no batching rule"):
        raggedfn.map(flip_then_sum, tokens(LENGTHS), strict=True)


def data_dependent(t):
    if t.sum() > 0:
        return t * 2
    return t


def test_data_dependent_control_flow_runs_the_whole_loop():
    x = tokens(LENGTHS)
    with pytest.warns(RaggedPerformanceWarning, match="f runs as a per-sample loop"):
        raggedfn.map(data_dependent, x)
    report = raggedfn.map_report(data_dependent, x)
    assert report.whole_loop is not None and "tracing failed" in report.whole_loop
    assert_same(report.output, loop(data_dependent, x))
    with pytest.raises(RaggedError, match="map: f could not be traced"):
        raggedfn.map(data_dependent, x, strict=True)


def branch_on_length(t):
    return t * 2 if t.shape[0] > 3 else t


def test_guard_on_a_size_is_checked_for_every_sample():
    # the first trace sees a long example; the short sample breaks its guard and gets
    # a trace of its own (the other branch): both groups run batched and merge
    x = tokens((5, 2, 4))
    report = raggedfn.map_report(branch_on_length, x)
    assert any(g.startswith("s") and "> 3" in g for g in report.guards), report.guards
    assert any("<= 3" in g for g in report.guards), report.guards
    assert report.fully_batched, str(report)
    assert_same(report.output, loop(branch_on_length, x))
    long_only = tokens((5, 4, 6))
    report = raggedfn.map_report(branch_on_length, long_only)
    assert report.fully_batched
    assert_same(report.output, loop(branch_on_length, long_only))
    assert raggedfn.map_cache_info(branch_on_length).plans == 2


def branch_then_index(t):
    return t[3] if t.shape[0] > 3 else t[0] * 0


def test_samples_no_trace_fits_run_per_sample_or_strict_refuses():
    x = tokens((5, 0, 4))  # the empty sample fits neither branch's trace (t[0] of nothing)
    with warnings.catch_warnings():
        # a sample without elements runs per sample without a performance warning (it
        # costs nothing), and raises as the loop does
        warnings.simplefilter("error", RaggedPerformanceWarning)
        with pytest.raises(IndexError, match="index 0 is out of bounds") as error:
            raggedfn.map(branch_then_index, x)
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]
    with pytest.warns(RaggedPerformanceWarning, match="some samples run per sample"):
        raggedfn.map(lambda t: t[len(t) // 2], tokens((5, 2, 4, 3, 6, 7)))
    # strict=True: an empty sample may run per sample (it costs nothing), and raises
    # as the loop does; a non-empty sample no plan fits is refused
    with pytest.raises(IndexError, match="index 0 is out of bounds") as error:
        raggedfn.map(branch_then_index, x, strict=True)
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]
    with pytest.raises(RaggedError, match="strict=True refuses"):
        raggedfn.map(lambda t: t[len(t) // 2], tokens((5, 2, 4, 3, 6, 7)), strict=True)
    fits = tokens((5, 2, 4))
    assert_same(raggedfn.map(branch_then_index, fits), loop(branch_then_index, fits))


def test_squeeze_of_a_ragged_axis_of_size_one_is_refused():
    with pytest.raises(RaggedError, match="squeeze of ragged axis"):
        raggedfn.map(lambda t: t[:, None].squeeze(), tokens((3, 1)))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: raggedfn.map(lambda t: t, torch.ones(3), in_dims=None), "no argument is mapped"),
        (lambda: raggedfn.map(lambda t, s: t, tokens((1, 2)), torch.ones(3, 2)), "disagree"),
        (lambda: raggedfn.map(lambda t: t, tokens((1,)), in_dims=(0, 0)), "in_dims has 2"),
        (lambda: raggedfn.map(lambda t: t, tokens((1,)), in_dims=1), "0 or None"),
        (lambda: raggedfn.map(lambda t: t, [1, 2], in_dims=0), "must be a Ragged or a tensor"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(RaggedError, match=f"map: .*{match}"):
        call()


# ----- composition -------------------------------------------------------------------


def mlp(t, p):
    h = F.gelu(F.linear(t, p["w1"], p["b1"]))
    return F.layer_norm(t + F.linear(h, p["w2"], p["b2"]), (D,))


def mlp_params(dtype=torch.float64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(16, D, generator=gen, dtype=dtype) / 4,
        "b1": torch.randn(16, generator=gen, dtype=dtype),
        "w2": torch.randn(D, 16, generator=gen, dtype=dtype) / 4,
        "b2": torch.randn(D, generator=gen, dtype=dtype),
    }


def test_grad_vjp_jacrev_match_the_loop():
    x = tokens(LENGTHS)
    params = mlp_params()

    def loss(p):
        return raggedfn.map(mlp, x, p, in_dims=(0, None)).values.pow(2).sum()

    def loss_loop(p):
        return sum(o.pow(2).sum() for o in loop(mlp, x, p))

    got, want = torch.func.grad(loss)(params), torch.func.grad(loss_loop)(params)
    for k in params:
        torch.testing.assert_close(got[k], want[k])

    def on_values(v):
        return raggedfn.map(mlp, x.with_values(v), params, in_dims=(0, None)).values

    out, pullback = torch.func.vjp(on_values, x.values)
    cotangent = torch.randn_like(out)
    (grad_values,) = pullback(cotangent)
    per_sample = [t.clone().requires_grad_() for t in samples(x)]
    outs = [mlp(t, params) for t in per_sample]
    cot = samples(x.with_values(cotangent))
    torch.autograd.backward(outs, cot)
    torch.testing.assert_close(grad_values, pack_like([t.grad for t in per_sample], x))

    small = tokens((2, 1), dim=D)
    jac = torch.func.jacrev(
        lambda v: raggedfn.map(mlp, small.with_values(v), params, in_dims=(0, None)).values
    )(small.values)
    parts = samples(small)
    for i, t in enumerate(parts):
        block = torch.autograd.functional.jacobian(lambda s: mlp(s, params), t)
        start = sum(p.shape[0] for p in parts[:i])
        n = t.shape[0]
        torch.testing.assert_close(jac[start : start + n, :, start : start + n, :], block)


def test_vmap_over_an_ensemble_of_parameters():
    x = tokens(LENGTHS)
    ensemble = [mlp_params(seed=s) for s in range(3)]
    stacked = {k: torch.stack([p[k] for p in ensemble]) for k in ensemble[0]}
    out = torch.func.vmap(lambda p: raggedfn.map(mlp, x, p, in_dims=(0, None)).values)(stacked)
    for e, p in enumerate(ensemble):
        torch.testing.assert_close(out[e], pack_like(loop(mlp, x, p), x))


# ----- models written per sample, trained with torch.func.grad ----------------------------


def bert_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    return layer.double()


def pairformer_block(p_state, s, params):
    """Pair update from single features, triangle-style attention with pair bias, transition."""
    n = s.shape[0]
    outer = F.linear(s, params["left"])[:, None, :] * F.linear(s, params["right"])[None, :, :]
    p_state = p_state + outer
    bias = F.linear(p_state, params["bias"]).permute(2, 0, 1)  # (H, n, n)
    q = F.linear(s, params["q"]).reshape(n, 2, -1).transpose(0, 1)
    k = F.linear(s, params["k"]).reshape(n, 2, -1).transpose(0, 1)
    v = F.linear(s, params["v"]).reshape(n, 2, -1).transpose(0, 1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    s = s + (logits.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
    p_state = p_state + F.relu(F.linear(F.layer_norm(p_state, (3,)), params["trans"]))
    return p_state, F.layer_norm(s, (D,))


def pairformer_params():
    gen = torch.Generator().manual_seed(7)

    def r(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) / 3).requires_grad_()

    return {
        "left": r(3, D),
        "right": r(3, D),
        "bias": r(2, 3),
        "q": r(D, D),
        "k": r(D, D),
        "v": r(D, D),
        "trans": r(3, 3),
    }


BERT = bert_layer()


def bert(t, p):
    """One sample (N, D) through the layer as a batch of one."""
    return torch.func.functional_call(BERT, p, (t[None],))[0]


MODELS = {
    "bert": lambda: (
        bert,
        {k: v.detach() for k, v in BERT.named_parameters()},
        lambda lengths: (tokens(lengths),),
    ),
    "mlp": lambda: (mlp, mlp_params(), lambda lengths: (tokens(lengths),)),
    "pairformer": lambda: (
        lambda p_state, s, prm: pairformer_block(p_state, s, prm),
        {k: v.detach() for k, v in pairformer_params().items()},
        lambda lengths: (pairs(lengths), tokens(lengths, seed=9)),
    ),
}


def _loss(outputs):
    leaves = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    total = 0
    for o in leaves:
        total = total + (o.values if isinstance(o, raggedfn.Ragged) else o).pow(2).mean()
    return total


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_equal_the_loop_and_train(name):
    f, params, make = MODELS[name]()
    batch = make((4, 2, 6))
    in_dims = (0,) * len(batch) + (None,)
    report = raggedfn.map_report(f, *batch, params, in_dims=in_dims)
    assert report.fully_batched, str(report)
    expected = loop(f, *batch, params)
    if isinstance(report.output, tuple):
        for j, part in enumerate(report.output):
            assert_same(part, [e[j] for e in expected])
    else:
        assert_same(report.output, expected)

    def loss(p):
        return _loss(raggedfn.map(f, *batch, p, in_dims=in_dims))

    def loss_loop(p):
        per = loop(f, *batch, p)
        if isinstance(per[0], tuple):
            cols = list(zip(*per, strict=True))
            return sum(
                sum(o.pow(2).sum() for o in col) / sum(o.numel() for o in col) for col in cols
            )
        return sum(o.pow(2).sum() for o in per) / sum(o.numel() for o in per)

    trained = {k: v.clone().requires_grad_() for k, v in params.items()}
    reference = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.Adam(trained.values(), lr=1e-2)
    opt_ref = torch.optim.Adam(reference.values(), lr=1e-2)
    losses = []
    for _ in range(3):
        grads = torch.func.grad(loss)({k: v.detach() for k, v in trained.items()})
        grads_ref = torch.func.grad(loss_loop)({k: v.detach() for k, v in reference.items()})
        for k in trained:
            torch.testing.assert_close(grads[k], grads_ref[k])
            trained[k].grad, reference[k].grad = grads[k], grads_ref[k]
        opt.step()
        opt_ref.step()
        losses.append(float(loss({k: v.detach() for k, v in trained.items()})))
    assert losses[-1] < losses[0]
    for k in trained:
        torch.testing.assert_close(trained[k], reference[k])


# ----- more rules: einsum, group_norm, indexing along ragged axes, embedding -------------


@pytest.mark.parametrize(
    "f",
    [
        lambda t: torch.einsum("nd,md->nm", t, t),
        lambda t: torch.einsum("nd,de->ne", t, W.T),
        lambda t: torch.einsum("nd,nd->d", t, t),
        lambda t: torch.einsum("nd,me->nme", t, t[:, :2]),
        lambda t: torch.einsum("nd,md,me->ne", t, t, t),
    ],
)
def test_einsum(f):
    x = tokens(LENGTHS)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_group_norm_over_ragged_spatial_axes():
    gen = torch.Generator().manual_seed(4)
    images = raggedfn.from_list(
        [torch.randn(6, h, h + 1, generator=gen, dtype=torch.float64) for h in (2, 3, 1)],
        ragged_dims=(2, 3),
    )
    gamma, beta = weights(6, seed=8), weights(6, seed=9)

    def f(img):
        return F.group_norm(img[None], 3, gamma, beta)[0]

    report = raggedfn.map_report(f, images)
    assert_same(report.output, loop(f, images))
    assert report.fully_batched, str(report)


@pytest.mark.parametrize(
    ("f", "lengths"),
    [
        (lambda t: t[0], (3, 1, 5)),  # first token (CLS pooling): a fixed-shape output
        (lambda t: t[-1] - t[0], (3, 1, 5)),
        (lambda t: t.narrow(0, 1, 1), (3, 2, 5)),
        (lambda t: t[:2] * 2, (3, 2, 5)),
        (lambda t: t[:2] * 2, (3, 1, 0, 5)),
        (lambda t: t[-2:] * 2, (3, 1, 0, 5)),
        (lambda t: t[1:-1][::2], (7, 1, 0, 2, 3)),
        (lambda t: t[1:].mean(0), (3, 2, 5)),
        (lambda t: torch.stack([t[:-1], t[1:]], -1).sum(-1), (3, 0, 5)),
    ],
)
def test_indexing_along_the_ragged_axis(f, lengths):
    x = tokens(lengths)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_a_slice_is_ragged_whatever_the_lengths_of_this_batch():
    # t[:2] has min(2, N) rows: a ragged axis decided by f, not by this batch
    for lengths in ((3, 1, 5), (3, 4, 5)):
        x = tokens(lengths)
        report = raggedfn.map_report(lambda t: t[:2] * 2, x)
        assert isinstance(report.output, raggedfn.Ragged)
        assert report.fully_batched, str(report)
        assert_same(report.output, loop(lambda t: t[:2] * 2, x))


def test_select_out_of_range_raises_naming_the_sample():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RaggedPerformanceWarning)  # empty: no warning
        with pytest.raises(IndexError, match="index 0 is out of") as error:
            raggedfn.map(lambda t: t[0], tokens((2, 0)))
    assert error.value.__notes__ == ["raggedfn.map: raised by f for sample 1"]


def test_embedding_of_ragged_token_ids():
    ids = raggedfn.from_list([torch.tensor(v, dtype=torch.long) for v in ([1, 2, 0], [], [4, 4])])
    table = weights(5, D, seed=10)

    def f(i, table):
        return F.embedding(i, table).sum(0) + F.embedding(i, table).softmax(0).amax(-1).sum()

    report = raggedfn.map_report(f, ids, table, in_dims=(0, None))
    assert_same(report.output, loop(f, ids, table))
    assert report.fully_batched, str(report)


def test_dense_per_sample_inputs_use_vmap_and_mix_with_ragged():
    x = tokens(LENGTHS)
    dense = weights(len(LENGTHS), 4, D, seed=11)

    def f(t, m):
        pooled = torch.linalg.det(m[:, :4] @ m[:, :4].T + torch.eye(4, dtype=m.dtype))
        return t * pooled + (m.sum(0) @ t.T).sum()

    report = raggedfn.map_report(f, x, dense)
    assert_same(report.output, [f(t, m) for t, m in zip(samples(x), dense, strict=True)])
    assert report.fully_batched, str(report)


# ----- the trace cache ------------------------------------------------------------------

CAPTURED = weights(D, D, seed=12)


def uses_global(t):
    return t @ CAPTURED


def scaled_by(scale):
    return lambda t: t * scale


def test_cache_hits_recreated_lambdas_and_sees_rebound_globals():
    global CAPTURED
    x = tokens(LENGTHS)
    for seed in range(3):  # a new lambda each step, capturing a new tensor: one trace
        scale = weights(D, seed=13 + seed)
        f = scaled_by(scale)
        assert_same(raggedfn.map(f, x), loop(f, x))
    assert raggedfn.map_cache_info(f).traces == 1
    assert_same(raggedfn.map(uses_global, x), loop(uses_global, x))
    old = CAPTURED
    try:
        CAPTURED = old * 2  # rebinding: read afresh, never the stale tensor, no new trace
        assert_same(raggedfn.map(uses_global, x), loop(uses_global, x))
    finally:
        CAPTURED = old
    assert raggedfn.map_cache_info(uses_global).traces == 1


def test_modules_called_directly_get_gradients_and_see_in_place_updates():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(D, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model = model.double()
    x = tokens(LENGTHS)
    report = raggedfn.map_report(model, x)
    assert report.fully_batched, str(report)
    report.output.values.pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(o.pow(2).sum() for o in loop(model, x)).backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    with torch.no_grad():
        model[0].weight.mul_(-1)
    assert_same(raggedfn.map(model, x), loop(model, x))


def writes_in_place(t):
    h = t * 1
    row = h[0]
    row.add_(1.0)  # writes through the view into h
    return torch.relu_(h)


def test_in_place_ops_run_the_whole_loop():
    x = tokens((2, 3, 1))
    report = raggedfn.map_report(writes_in_place, x)
    assert "in-place op" in (report.whole_loop or "")
    assert_same(report.output, loop(writes_in_place, x))


def test_gradients_through_a_per_node_loop():
    x = tokens(LENGTHS)

    def f(t, w):
        return torch.flip(F.linear(t, w), [0]).cumsum(0)

    def loss(w):
        return raggedfn.map(f, x, w, in_dims=(0, None)).values.pow(2).sum()

    with pytest.warns(RaggedPerformanceWarning, match="flip"):
        got = torch.func.grad(loss)(W)
    want = torch.func.grad(lambda w: sum(o.pow(2).sum() for o in loop(f, x, w)))(W)
    torch.testing.assert_close(got, want)


def test_splits_along_dense_axes():
    x = tokens(LENGTHS)

    def f(t):
        q, k, v = t[:, :6].chunk(3, -1)
        a, b = t.split([3, 5], -1)
        first, *_ = t[:, :2].unbind(-1)
        return q * k + v, a.sum(-1) + b.sum(-1) + first

    report = raggedfn.map_report(f, x)
    expected = loop(f, x)
    assert_same(report.output[0], [e[0] for e in expected])
    assert_same(report.output[1], [e[1] for e in expected])
    assert report.fully_batched, str(report)


def _grad_fns(t):
    """Names of every autograd node behind ``t``."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


def test_unbind_of_a_dense_axis_is_one_unbind_in_values_and_gradients():
    # the fused-QKV pattern: [N, 3, H, Dh] -> permute -> unbind(0); batched as one unbind of
    # the packed values (its backward stacks), not one select per piece (each zero-fills)
    x = tokens(LENGTHS, dim=12)
    w = weights(12, 12, seed=5)

    def f(t, w):
        q, k, v = (t @ w).view(t.shape[0], 3, 2, 2).permute(1, 2, 0, 3).unbind(0)
        return (q * k + v.exp()).transpose(0, 1).reshape(t.shape[0], 4)

    values = x.values.clone().requires_grad_(True)
    w_leaf = w.clone().requires_grad_(True)
    out = raggedfn.map(f, x.with_values(values), w_leaf, in_dims=(0, None))
    assert "UnbindBackward0" in _grad_fns(out.values)
    assert "SelectBackward0" not in _grad_fns(out.values)
    expected = loop(f, x, w)
    assert_same(out, expected)
    cotangent = torch.randn_like(out.values)
    got = torch.autograd.grad(out.values, [values, w_leaf], cotangent)
    parts = [t.clone().requires_grad_(True) for t in samples(x)]
    w_ref = w.clone().requires_grad_(True)
    want_out = torch.cat([f(t, w_ref) for t in parts])
    want = torch.autograd.grad(want_out, [*parts, w_ref], cotangent)
    torch.testing.assert_close(got[0], torch.cat(want[:-1]))
    torch.testing.assert_close(got[1], want[-1])


def test_max_and_min_with_indices():
    x = tokens((3, 1, 5))

    def f(t):
        top, where = t.max(0)
        low, at = torch.min(t, -1, keepdim=True)
        return top * where, low + at

    report = raggedfn.map_report(f, x)
    expected = loop(f, x)
    assert_same(report.output[0], [e[0] for e in expected])
    assert_same(report.output[1], [e[1] for e in expected])
    assert report.fully_batched, str(report)


def in_place_on_fresh_values(t):
    h = t * 2
    h.relu_()
    h += 1
    return F.relu(h, inplace=True) * t


def test_in_place_ops_on_fresh_intermediates_are_batched():
    x = tokens(LENGTHS)
    report = raggedfn.map_report(in_place_on_fresh_values, x)
    assert_same(report.output, loop(in_place_on_fresh_values, x))
    assert report.fully_batched, str(report)
    model = torch.nn.Sequential(torch.nn.Linear(D, 4), torch.nn.ReLU(inplace=True)).double()
    report = raggedfn.map_report(model, x)
    assert_same(report.output, loop(model, x))
    assert report.fully_batched, str(report)


def test_whole_loop_with_pytree_arguments():
    batch = {"a": tokens(LENGTHS), "b": weights(len(LENGTHS), D, seed=14)}

    def f(inputs):
        t = inputs["a"]
        if t.sum() > 0:  # data-dependent: the whole call runs per sample
            return t * inputs["b"]
        return t - inputs["b"]

    report = raggedfn.map_report(f, batch)
    assert report.whole_loop is not None
    expected = [f({"a": t, "b": b}) for t, b in zip(samples(batch["a"]), batch["b"], strict=True)]
    assert_same(report.output, expected)


def test_guard_fallback_keeps_the_traced_output_structure():
    trace_batch = tokens((5, 4))
    raggedfn.map(branch_on_length, trace_batch)  # traced on the long branch
    equal_short = tokens((2, 2))  # all lengths equal: still a Ragged result
    out = raggedfn.map(branch_on_length, equal_short)
    assert isinstance(out, raggedfn.Ragged)
    assert_same(out, loop(branch_on_length, equal_short))


def masked_attention(t):
    n = t.shape[0]
    position = torch.arange(n)
    keep = (position[None, :] <= position[:, None] + 1) & (position[None, :] != 2)
    bias = (position[:, None] - position[None, :]).to(t.dtype) / 4
    a = F.scaled_dot_product_attention(t[None], t[None], t[None], attn_mask=keep)[0]
    b = F.scaled_dot_product_attention(t[None], t[None], t[None], attn_mask=bias)[0]
    earlier = position[None, :] < position[:, None]  # the first query sees no key: zeros
    c = F.scaled_dot_product_attention(t[None], t[None], t[None], attn_mask=earlier)[0]
    return a + b + c


def test_attention_with_per_sample_masks():
    x = tokens((3, 1, 5, 0))
    report = raggedfn.map_report(masked_attention, x)
    assert_same(report.output, loop(masked_attention, x))
    assert report.fully_batched, str(report)


def _finite_loss_grads(f, x):
    """Gradients w.r.t. packed values of ``sum(sin(finite outputs))``: (map, loop)."""
    values = x.values.detach().requires_grad_()
    out = raggedfn.map(f, x.with_values(values))
    out = out.values if isinstance(out, raggedfn.Ragged) else out
    torch.where(torch.isfinite(out), out, 0).sin().sum().backward()
    parts = [t.detach().requires_grad_() for t in samples(x)]
    outs = [f(t) for t in parts]
    total = sum(torch.where(torch.isfinite(o), o, 0).sin().sum() for o in outs)
    grads = torch.autograd.grad(total, parts, allow_unused=True, materialize_grads=True)
    return values.grad, pack_like(grads, x)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t.mean((0, 1)),
        lambda t: t.logsumexp((0, 1)),
        lambda t: t.logsumexp(0),
        lambda t: t.sum((1, 0), keepdim=True),
        lambda t: t.prod(0),
        lambda t: t.any(0),
        lambda t: t.all(0),
        lambda t: torch.linalg.vector_norm(t),
        lambda t: torch.linalg.vector_norm(t, 1, dim=0),
        lambda t: t.softmax(0),
        lambda t: t.log_softmax(0),
    ],
)
def test_reductions_with_empty_samples_equal_the_loop_in_values_and_gradients(f):
    # sample 3 is all zeros: prod's and norm's derivatives at 0 are the delicate ones
    x = tokens((3, 0, 4, 2))
    x = x.with_values(torch.cat([x.values[:7], torch.zeros(2, D, dtype=x.values.dtype)]))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)
    if x.values.dtype.is_floating_point and report.output.dtype.is_floating_point:
        got, want = _finite_loss_grads(f, x)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: t.argmax(0),
        lambda t: t.argmin(0),
        lambda t: t.amax(0),
        lambda t: t.amin(0),
        lambda t: torch.max(t, 0)[1],
        lambda t: torch.min(t, 0)[1],
        lambda t: t.softmax(0),
    ],
)
def test_reductions_over_the_ragged_axis_propagate_nan_as_torch(f):
    # torch.argmax/argmin of a column with NaN give the first NaN's position
    x = tokens((3, 1, 4))
    values = x.values.clone()
    values[1, 2] = values[5, 0] = values[7, 0] = math.nan
    x = x.with_values(values)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


def test_safe_softmax_of_a_fully_masked_column_is_zero_with_zero_gradient():
    def f(t):
        return torch.ops.aten._safe_softmax(t, 0)

    x = tokens((3, 0, 2))
    values = x.values.clone()
    values[:3, 1] = values[3:, 4] = -math.inf
    x = x.with_values(values)
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)
    got, want = _finite_loss_grads(f, x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "f",
    [
        lambda p: p.cumsum(0),
        lambda p: p.cumsum(1),
        lambda p: p.permute(1, 0, 2).cumsum(0),
        lambda p: p.cumsum(2),
    ],
)
def test_cumsum_along_each_axis_of_pairs(f):
    x = pairs((3, 0, 2, 4))
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)
    got, want = _finite_loss_grads(f, x)
    torch.testing.assert_close(got, want)


def test_float32_cumsum_of_a_sample_after_a_large_one_keeps_its_precision():
    # a running sum over the whole packed batch minus each sample's start, both in
    # float32, would lose the small sample to the large one's total (2e7, ulp 2)
    gen = torch.Generator().manual_seed(0)
    big = torch.full((2000, 2), 1e4)
    small = torch.rand(5, 2, generator=gen) * 1e-2
    x = raggedfn.from_list([big, small, big[:3], small.flip(0)])
    f = lambda t: t.cumsum(0)  # noqa: E731
    report = raggedfn.map_report(f, x)
    assert_same(report.output, loop(f, x))
    assert report.fully_batched, str(report)


@pytest.mark.parametrize(
    "f",
    [
        lambda t: torch.max(t, 0)[0],
        lambda t: torch.min(t, 0)[0],
        lambda t: t.amax(0),
        lambda t: t.amin(0),
        lambda t: t.logsumexp(0),
        lambda t: t.softmax(0),
    ],
)
def test_gradients_through_ties_along_the_ragged_axis_equal_the_loop(f):
    # torch.max(t, dim) sends a tie's gradient to the returned index; amax shares it
    x = tokens((3, 1, 5))
    x = x.with_values((x.values * 1.5).round())
    got, want = _finite_loss_grads(f, x)
    torch.testing.assert_close(got, want)


def test_an_explicit_generator_made_inside_f_runs_per_sample():
    def f(t):  # every sample draws the same weights from a freshly seeded generator
        return F.linear(t, weights(4, D)).sum(0)

    x = tokens(LENGTHS)
    for _ in range(2):
        with pytest.warns(RaggedPerformanceWarning, match="Generator"):
            assert_same(raggedfn.map(f, x), loop(f, x))
        raggedfn._map.caching._cache.clear()
