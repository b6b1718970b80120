"""examples/hf_finetune.py: a tokenizer's padded batch through raggedfn.map equals the padded model."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from examples import hf_finetune


@functools.cache
def tokenizer():
    return hf_finetune.make_tokenizer()


def padded_batch(side: str, count: int = 6):
    tok = tokenizer()
    tok.padding_side = side
    texts, labels = hf_finetune.make_sentences(torch.Generator().manual_seed(0), count, 12)
    return tok(texts, padding=True, return_tensors="pt"), labels


@pytest.mark.parametrize("name", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_and_gradients_equal_the_padded_model(name, side):
    torch.manual_seed(0)
    model = hf_finetune.make_model(name, tokenizer().vocab_size, 16, 1).double().eval()
    batch, labels = padded_batch(side)
    mask = batch["attention_mask"]
    assert bool((mask[:, 0] == 0).any()) == (side == "left")  # the padding really is there

    got = hf_finetune.classify_batch(model, batch["input_ids"], mask)
    loss = F.cross_entropy(got, labels)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    # the reference: the model on the same sentences right-padded (a left-padded batch
    # would put padding where the classifier reads its [CLS] token)
    right, _ = padded_batch("right")
    want = model(input_ids=right["input_ids"], attention_mask=right["attention_mask"]).logits
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    grads_want = torch.autograd.grad(
        F.cross_entropy(want, labels), list(model.parameters()), allow_unused=True
    )
    for g, w in zip(grads, grads_want, strict=True):
        if w is None:
            assert g is None or not bool(g.any())
        else:
            torch.testing.assert_close(g, w, atol=1e-9, rtol=0)


def test_sentences_are_labelled_by_their_words():
    texts, labels = hf_finetune.make_sentences(torch.Generator().manual_seed(3), 50, 10)
    for text, label in zip(texts, labels.tolist(), strict=True):
        words = text.split()
        score = sum(w in hf_finetune.POSITIVE for w in words) - sum(
            w in hf_finetune.NEGATIVE for w in words
        )
        assert score != 0 and label == int(score > 0)


def test_example_fine_tunes_at_a_small_size(capsys):
    args = ["--steps", "60", "--batch", "16", "--hidden", "32", "--lr", "3e-3", "--threads", "1"]
    assert hf_finetune.main([*args, "--min-accuracy", "0.7"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "vs the padded model" in out


@pytest.mark.parametrize("name", ["roberta", "distilbert"])
def test_example_runs_left_padded(name, capsys):
    args = ["--model", name, "--padding-side", "left", "--steps", "2", "--batch", "4"]
    assert hf_finetune.main([*args, "--hidden", "16", "--min-accuracy", "0", "--threads", "1"]) == 0
    assert "left-padded" in capsys.readouterr().out
