"""Fine-tune a Hugging Face encoder padding-free: the tokenizer's padded batch in, no padding computed.

A tokenizer pads every batch to its longest sentence and marks the real tokens
with ``attention_mask``; the model then spends most of its time on padding.
Here the padded batch becomes one ragged value with
``raggedfn.from_padded(input_ids, mask=attention_mask)`` (either padding side),
and the unchanged Hugging Face model runs on ONE sentence at a time inside
``raggedfn.map``, which executes it batched over the packed tokens. Training is
plain PyTorch: ``loss.backward()`` and an optimizer over ``model.parameters()``.

Everything is built here, nothing is downloaded: a word-level tokenizer over a
small vocabulary, a model from a config (``--model bert|roberta|distilbert``),
and a toy sentiment task (a sentence is positive when it holds more positive
than negative words). At the end the model's logits through ``raggedfn.map`` are
compared with the same model on the padded batch with its ``attention_mask``.

Needs ``transformers`` (``pip install -c constraints.txt -e '.[examples]'``).
Run ``python examples/hf_finetune.py --help`` for the knobs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

import raggedfn

# torch 2.13 warns when its own code instantiates the autograd.Function of a segment
# primitive under torch.func; harmless (the test suite filters it the same way)
warnings.filterwarnings(
    "ignore", message=".*should not be instantiated", category=DeprecationWarning
)

POSITIVE = ["good", "great", "fine", "lovely", "superb"]
NEGATIVE = ["bad", "awful", "poor", "dull", "sad"]
NEUTRAL = ["the", "a", "movie", "plot", "was", "and", "very", "actor", "film", "scene"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def make_tokenizer() -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over the task's words, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIAL + POSITIVE + NEGATIVE + NEUTRAL)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def make_sentences(gen: torch.Generator, count: int, max_words: int) -> tuple[list[str], Tensor]:
    """Sentences of 3..max_words words; label 1 when positive words outnumber negative ones."""
    texts, labels = [], []
    while len(texts) < count:
        n = int(torch.randint(3, max_words + 1, (1,), generator=gen))
        kinds = torch.randint(0, 4, (n,), generator=gen)  # half neutral, a quarter each side
        words = []
        for kind in kinds.tolist():
            pool = POSITIVE if kind == 0 else NEGATIVE if kind == 1 else NEUTRAL
            words.append(pool[int(torch.randint(0, len(pool), (1,), generator=gen))])
        score = sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)
        if score != 0:  # no ties: both labels are learnable
            texts.append(" ".join(words))
            labels.append(int(score > 0))
    return texts, torch.tensor(labels)


def make_model(name: str, vocab_size: int, hidden: int, layers: int) -> Any:
    """A sequence classifier built from a config (random weights, nothing downloaded)."""
    import transformers

    size = {"vocab_size": vocab_size, "max_position_embeddings": 128}
    if name == "distilbert":
        config = transformers.DistilBertConfig(
            dim=hidden, n_layers=layers, n_heads=4, hidden_dim=4 * hidden, **size
        )
        config.attention_dropout = 0.0
    else:
        cls = transformers.BertConfig if name == "bert" else transformers.RobertaConfig
        if name == "roberta":  # RoBERTa's positions start after the padding id
            size["max_position_embeddings"] += 2
        config = cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=4 * hidden,
            pad_token_id=0,
            **size,
        )
        # dropout inside attention runs per sample in map today (hidden dropout is batched)
        config.attention_probs_dropout_prob = 0.0
    config.num_labels = 2
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForSequenceClassification.from_config(config)


def classify_batch(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Logits ``[B, 2]`` of a tokenizer's padded batch, computed without the padding."""
    tokens = raggedfn.from_padded(input_ids, mask=attention_mask)  # (B, N*) token ids
    params = dict(model.named_parameters())
    # map keys its traces on the function and the constants it captures: capturing the
    # mode keeps the training trace (with dropout) and the evaluation trace apart
    training = model.training

    def classify(ids: Tensor, params: dict[str, Tensor]) -> Tensor:  # ONE sentence [N]
        assert model.training == training
        return torch.func.functional_call(model, params, (ids[None],)).logits[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without a batching rule yet warn once
        return raggedfn.map(classify, tokens, params, in_dims=(0, None))


def largest_difference_to_padded(model: Any, batch: dict[str, Tensor]) -> float:
    """``raggedfn.map`` vs the model on the right-padded batch with its mask (eval mode).

    Right padding, whatever the tokenizer did: a left-padded batch would put padding
    where the classifier reads its ``[CLS]`` token (position 0).
    """
    tokens = raggedfn.from_padded(batch["input_ids"], mask=batch["attention_mask"])
    right_ids, right_mask = raggedfn.to_padded(tokens), raggedfn.mask(tokens).long()
    model.eval()
    with torch.no_grad():
        ragged = classify_batch(model, batch["input_ids"], batch["attention_mask"])
        padded = model(input_ids=right_ids, attention_mask=right_mask).logits
    model.train()
    return float((ragged - padded).abs().max())


def train(args: argparse.Namespace) -> tuple[float, float]:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    tokenizer = make_tokenizer()
    tokenizer.padding_side = args.padding_side
    model = make_model(args.model, tokenizer.vocab_size, args.hidden, args.layers).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(
        f"fine-tuning a {args.layers}-layer {args.model} (hidden {args.hidden}) padding-free: "
        f"{args.steps} steps of {args.batch} sentences, {args.padding_side}-padded by the tokenizer"
    )
    losses: list[float] = []
    real = padded = 0
    bar = tqdm(range(1, args.steps + 1), desc="  training", unit="step", dynamic_ncols=True)
    for step in bar:
        texts, labels = make_sentences(gen, args.batch, args.max_words)
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        real += int(batch["attention_mask"].sum())
        padded += batch["attention_mask"].numel()
        logits = classify_batch(model, batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == args.steps:
            bar.set_postfix(loss=f"{statistics.fmean(losses[-10:]):.3f}")
    bar.close()
    texts, labels = make_sentences(gen, 256, args.max_words)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        accuracy = float(
            (
                classify_batch(model, batch["input_ids"], batch["attention_mask"]).argmax(-1)
                == labels
            )
            .float()
            .mean()
        )
    difference = largest_difference_to_padded(model, batch)
    print(
        f"loss {statistics.fmean(losses[:10]):.3f} -> {statistics.fmean(losses[-10:]):.3f}; "
        f"held-out accuracy {accuracy:.3f} (chance 0.5); the model computed "
        f"{real / padded:.0%} of the padded tokens"
    )
    print(f"logits through raggedfn.map vs the padded model: largest difference {difference:.1e}")
    return accuracy, difference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bert", "roberta", "distilbert"], default="bert")
    parser.add_argument("--padding-side", choices=["right", "left"], default="right")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-words", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="map vs padded logits")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    accuracy, difference = train(args)
    if difference > args.tolerance:
        print(f"FAILED: map and the padded model differ by {difference:.1e}")
        return 1
    if accuracy < args.min_accuracy:
        print(f"FAILED: accuracy {accuracy:.3f} is below {args.min_accuracy} (chance is 0.5)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
