"""Compiled training steps of Hugging Face models through ``raggedfn.map``
(``torch.compile(fullgraph=True, dynamic=True)``, aot_eager: the graph and its backward
without inductor's code generation), as people train: BERT in train mode with attention
dropout, and Llama without a cache (``use_cache=False``: transformers builds a causal mask
from positions inside the per-sample function). Ten batches of new lengths make at most
two graphs; Llama's step equals eager and the padded model, and BERT's dropout is applied,
per sample and without changing the expectation (BERT without dropout compiled:
``test_map_compile_hf.py``)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import raggedfn
from property_tests.reference import samples

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

VOCAB = 50
LENGTHS = [[5, 9, 3], [7, 2, 6, 4], [8, 3], [11, 4, 6], [3, 3], [12, 2, 5, 9, 4],
           [6, 10], [2, 4, 7], [9, 9, 5], [4, 13]]  # fmt: skip


def _bert(dropout: float) -> Any:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).double().train()


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaModel(config).double().train()


MODELS = {"bert": _bert(0.5), "llama": _llama()}


def _one(name: str, t: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    kwargs = {"use_cache": False} if name == "llama" else {}
    out = torch.func.functional_call(MODELS[name], p, (t[None],), kwargs)
    return out.last_hidden_state[0]


def _step(name: str):
    def one(t, p):
        return _one(name, t, p)

    def step(values, offsets, sizes, p):
        tokens = raggedfn.Ragged(values, offsets, sizes, raggedfn.Layout.standard(1, 0))
        out = raggedfn.map(one, tokens, p, in_dims=(0, None))
        return out.values.square().sum(), out.values

    return step


def _batch(lengths: list[int], seed: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_lengths(torch.randint(1, VOCAB, (sum(lengths),), generator=gen), lengths)


def _grads(step, x, p):
    loss, out = step(x.values, x.offsets, x.sizes, p)
    return out.detach(), torch.autograd.grad(loss, list(p.values()))


@functools.cache
def compiled(name: str) -> dict[str, Any]:
    """Ten batches through the compiled step and the eager one (same parameters)."""
    p = {k: v.detach().requires_grad_() for k, v in MODELS[name].named_parameters()}
    step = _step(name)
    warm = _batch([4, 5], 99)
    step(warm.values, warm.offsets, warm.sizes, p)  # map traces f eagerly first
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    runs = []
    for seed, lengths in enumerate(LENGTHS):
        x = _batch(lengths, seed)
        runs.append((x, _grads(fn, x, p), _grads(step, x, p)))
    return {"runs": runs, "graphs": counters["stats"]["unique_graphs"], "fn": fn, "p": p}


def test_llama_without_cache_compiled_step_equals_eager_in_two_graphs():
    found = compiled("llama")
    assert found["graphs"] <= 2
    for _, (out, grads), (want, want_grads) in found["runs"]:
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_llama_without_cache_eager_map_equals_the_padded_model():
    x = _batch([5, 9, 3], 0)
    got = raggedfn.map(lambda t: MODELS["llama"](input_ids=t[None], use_cache=False)
                       .last_hidden_state[0], x)  # fmt: skip
    ids = raggedfn.to_padded(x)
    mask = raggedfn.mask(x).long()
    want = MODELS["llama"](input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
    torch.testing.assert_close(got.values, want, rtol=1e-10, atol=1e-10)


def test_bert_with_attention_dropout_compiles_to_two_graphs_and_drops_per_sample():
    found = compiled("bert")
    assert found["graphs"] <= 2
    fn, p = found["fn"], found["p"]
    # samples with equal ids get different dropout draws
    x = raggedfn.from_lengths(torch.tensor([3, 4, 5, 6] * 3), [4, 4, 4])
    _, out = fn(x.values, x.offsets, x.sizes, p)
    parts = samples(x.with_values(out.detach()))
    assert not torch.equal(parts[0], parts[1]) and not torch.equal(parts[1], parts[2])
    # the expectation of dropout is the output without it (the model's eval mode)
    model = MODELS["bert"]
    with torch.no_grad():
        mean = torch.stack([fn(x.values, x.offsets, x.sizes, p)[1] for _ in range(200)]).mean(0)
        model.eval()
        try:
            want = torch.cat([model(input_ids=s[None]).last_hidden_state[0] for s in samples(x)])
        finally:
            model.train()
    assert (mean - want).abs().mean() < 0.1 * want.abs().mean()
    assert counters["stats"]["unique_graphs"] <= 2
