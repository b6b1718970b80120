"""Hugging Face models (2 layers, built from configs, float64) through ``raggedfn.map``.

Each model runs per sample inside ``raggedfn.map`` and must equal the padded model
with an ``attention_mask`` (< 1e-9), forward and in the gradients of a
``torch.func.functional_call`` training step. Encoders are right-padded; decoders
left-padded (as for generation) with position ids counted from the mask, which also
exercises ``from_padded(mask=)`` on left padding.

Whether each runs *fully batched* (no per-sample loop for any op) is a separate
test: the models that still fall back are strict xfails naming the op, so a new
batching rule turns them into failures until the mark is removed.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

import raggedfn
from property_tests.reference import pad_by_hand

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS = 100, 32, 4
LENGTHS = [5, 9, 3, 7, 2]
TOLERANCE = {"atol": 1e-9, "rtol": 0.0}


def _config(name: str) -> Any:
    """A 2-layer config of the model family ``name``, dropout off."""
    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_attention_heads": HEADS}
    common |= {"intermediate_size": 64, "max_position_embeddings": 64}
    if name in ("bert", "bert_eager"):
        config = transformers.BertConfig(num_hidden_layers=2, **common)
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    elif name == "roberta":
        # RoBERTa's positions start after pad_token_id, so it needs 2 more slots
        common["max_position_embeddings"] = 66
        config = transformers.RobertaConfig(num_hidden_layers=2, pad_token_id=1, **common)
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    elif name == "distilbert":
        config = transformers.DistilBertConfig(
            n_layers=2, dim=HIDDEN, n_heads=HEADS, hidden_dim=64, vocab_size=VOCAB,
            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
    elif name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    elif name in ("llama_gqa", "llama"):
        kv_heads = 2 if name == "llama_gqa" else HEADS
        config = transformers.LlamaConfig(
            num_hidden_layers=2, num_key_value_heads=kv_heads, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, **common,
        )  # fmt: skip
    else:
        raise AssertionError(name)
    config._attn_implementation = "eager" if name == "bert_eager" else "sdpa"
    return config


DECODERS = ("gpt2", "llama_gqa", "llama")
MODELS = ("bert", "bert_eager", "roberta", "distilbert", "gpt2", "llama_gqa", "llama")


@functools.cache
def model_of(name: str) -> Any:
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(_config(name)).double()
    return model.train()  # a training step; dropout is off, so it is deterministic


def batch() -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (sum(LENGTHS),), generator=gen)
    return raggedfn.from_lengths(ids, LENGTHS)


def per_sample(model: Any):
    """The per-sample function: one ``[N]`` sequence of ids -> ``[N, hidden]``."""

    def f(ids: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(model, params, (ids[None],))
        return out.last_hidden_state[0]

    return f


def padded_inputs(name: str, ids: raggedfn.Ragged) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token ids padded on the model's side, and its keyword arguments."""
    side = "left" if name in DECODERS else "right"
    padded, mask = pad_by_hand(raggedfn.unbind(ids), side, max(LENGTHS))
    kwargs: dict[str, Any] = {"attention_mask": mask}
    if name in DECODERS:  # left padding: count positions from the first real token
        kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    return padded, kwargs


def ragged_forward(model: Any, params: dict[str, torch.Tensor], ids: raggedfn.Ragged) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-sample fallback warns, by design
        return raggedfn.map(per_sample(model), ids, params, in_dims=(0, None))


def padded_forward(
    name: str, model: Any, params: dict[str, torch.Tensor], ids: raggedfn.Ragged
) -> raggedfn.Ragged:
    padded, kwargs = padded_inputs(name, ids)
    out = torch.func.functional_call(model, params, (padded,), kwargs).last_hidden_state
    return raggedfn.from_padded(out, mask=kwargs["attention_mask"])


def params_of(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("name", MODELS)
def test_model_through_map_equals_the_padded_model(name):
    model, ids = model_of(name), batch()
    params = params_of(model)
    got = ragged_forward(model, params, ids)
    want = padded_forward(name, model, params, ids)
    assert isinstance(got, raggedfn.Ragged) and got.lengths.tolist() == LENGTHS
    assert torch.equal(got.offsets, want.offsets)
    torch.testing.assert_close(got.values, want.values, **TOLERANCE)
    # and both equal the model run on each sequence alone
    alone = torch.cat([model(input_ids=t[None]).last_hidden_state[0] for t in raggedfn.unbind(ids)])
    torch.testing.assert_close(got.values, alone.detach(), **TOLERANCE)


@pytest.mark.parametrize("name", MODELS)
def test_training_step_gradients_equal_the_padded_model(name):
    model, ids = model_of(name), batch()
    params = params_of(model)
    weights = torch.randn(
        sum(LENGTHS), HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )

    def ragged_loss(p):
        return (ragged_forward(model, p, ids).values * weights).sum()

    def padded_loss(p):
        return (padded_forward(name, model, p, ids).values * weights).sum()

    got = torch.func.grad(ragged_loss)(params)
    want = torch.func.grad(padded_loss)(params)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(
            got[key], want[key], **TOLERANCE, msg=lambda m, k=key: f"{k}: {m}"
        )
    # the check has teeth: the loss reaches every parameter but the unused pooler
    moved = [k for k in want if want[k].abs().max() > 0]
    assert len(moved) >= len(want) - 2, sorted(set(want) - set(moved))


FULLY_BATCHED = MODELS  # every model of the table runs without a per-sample loop


@pytest.mark.parametrize("name", FULLY_BATCHED)
def test_model_runs_fully_batched(name):
    model, ids = model_of(name), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-sample fallback warns; the report says it
        report = raggedfn.map_report(per_sample(model), ids, params_of(model), in_dims=(0, None))
    assert report.fully_batched, str(report)


def test_positions_segment_ids_and_cu_seqlens_match_the_flattening_collator():
    """HF's own padding-free collator gives the same packed index tensors."""
    ids = batch()
    collator = transformers.DataCollatorWithFlattening(
        return_seq_idx=True, return_flash_attn_kwargs=True, return_tensors="pt"
    )
    packed = collator([{"input_ids": t.tolist()} for t in raggedfn.unbind(ids)])
    assert torch.equal(packed["input_ids"][0], ids.values)
    assert torch.equal(packed["position_ids"][0], raggedfn.positions(ids).values)
    assert torch.equal(packed["seq_idx"][0].long(), raggedfn.segment_ids(ids))
    offsets, longest = raggedfn.cu_seqlens(ids)
    assert torch.equal(packed["cu_seq_lens_q"], offsets) and packed["max_length_q"] == longest
