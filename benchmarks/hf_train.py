"""One training step of nine Hugging Face model families: padded vs HF's packed input vs map.

Every model is built from its family's config (random weights, float32) at one size:
hidden 256, 2 layers, 4 heads, intermediate 1024, vocabulary 1024 (the embedding
table's dense gradient costs the same in every system; a small vocabulary keeps it
from hiding the rest), each config's default dropout, in ``train()`` mode, SDPA
attention where the family has it (eager otherwise). One batch of B = 16 lognormal
lengths (mean 128, clipped to [16, 512], the harness's ``lognormal`` seed), right
padded. The step: forward, loss = sum of squares of the real tokens' last hidden
states, ``loss.backward()`` (gradients of every parameter), one thread.

Systems, timed side by side in one process:

- ``padded``: ``model(input_ids, attention_mask=mask)`` on the padded ``[B, N_max]``
  batch (``use_cache=False`` for decoders).
- ``packed``: transformers' padding-free input: one row ``input_ids[None]`` of all
  real tokens with ``position_ids`` restarting at every sequence
  (``raggedfn.positions``), no attention mask, ``use_cache=False`` for decoders.
  transformers 5.25 finds the sequences in ``masking_utils.find_packed_sequence_indices``
  (a new sequence wherever a position is not the previous one plus 1), but only when
  the model hands its ``position_ids`` to ``create_*_mask`` with neither a 2-D mask nor
  a cache: BERT, ESM, GPT-2, Llama, Qwen2 and Mistral do; ModernBERT builds its masks
  without them, DeBERTa-v2 and T5 build no mask from positions at all (relative
  attention over the whole row), so there the packed sequences attend to each other.
  The record says so per family (``packed_keeps_sequences_apart``, from the float64
  comparison with ``padded``, and ``packed_note``, from reading the model code).
- ``map``: ``raggedfn.map(lambda ids: model(input_ids=ids[None]).last_hidden_state[0],
  tokens)`` with ``tokens = raggedfn.from_padded(input_ids, mask=attention_mask)``;
  ``raggedfn.map_report`` says whether it ran fully batched and what fell back.

Before timing, each family is checked once in float64 with dropout off (a copy of
the model in ``eval()``): every system's real-token hidden states and loss against
``padded``'s (:func:`check`; ``--check`` prints only that). ``map`` must agree; a
``packed`` that mixes sequences is timed but marked.

Timing: one warm-up step per system (map's trace), then ``--rounds`` rounds in which
every system runs once, in an order rotated from round to round and reversed every
other round (``benchmarks._standalone.rotated_rounds``); medians, and speedups as
medians of per-round ratios. Targets (reported, not asserted): map at least 4x
faster than padded and 2x faster than packed, for every family.

Run: ``python -m benchmarks.hf_train [--quick] [--family bert ...] [--rounds 7]
[--threads 1] [--json benchmarks/results/hf_train/hf_train.json --markdown
benchmarks/results/hf_train/hf_train.md]`` (the plot is written next to the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks import plots
from benchmarks._cases import DISTRIBUTIONS
from benchmarks._standalone import cli, header, rotated_rounds

FAMILIES = ("bert", "esm", "gpt2", "llama", "qwen2", "mistral", "modernbert", "deberta_v2", "t5")
DECODERS = frozenset({"gpt2", "llama", "qwen2", "mistral"})
SYSTEMS = ("padded", "packed", "map")
TARGETS = {"map_over_padded": 4.0, "map_over_packed": 2.0}
# float64 agreement with padded (hidden states, largest absolute difference)
AGREE = 1e-8

# what transformers 5.25 does with packed position_ids, per family (read from its code)
PACKED_NOTES = {
    "bert": "create_bidirectional_mask(position_ids=...) finds the sequences",
    "esm": "create_bidirectional_mask(position_ids=...) finds the sequences",
    "gpt2": "create_causal_mask(position_ids=...) finds the sequences",
    "llama": "create_causal_mask(position_ids=...) finds the sequences",
    "qwen2": "create_causal_mask(position_ids=...) finds the sequences",
    "mistral": "create_sliding_window_causal_mask(position_ids=...) finds the sequences",
    "modernbert": "its create_bidirectional_(sliding_window_)mask calls get no position_ids: "
    "the packed sequences attend to each other",
    "deberta_v2": "no mask from position_ids (disentangled relative attention over the whole "
    "row): the packed sequences attend to each other",
    "t5": "takes no position_ids (relative position bias over the whole row): the packed "
    "sequences attend to each other",
}


@dataclasses.dataclass(frozen=True)
class Size:
    batch: int
    mean: int  # of the lognormal lengths (clipped to [mean / 8, 4 mean])
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    window: int  # Mistral's sliding window, ModernBERT's half local window

    @property
    def lengths(self) -> list[int]:
        return DISTRIBUTIONS["lognormal"].lengths(self.batch, scale=self.mean / 128)


FULL = Size(batch=16, mean=128, hidden=256, layers=2, heads=4, intermediate=1024, vocab=1024,
            window=64)  # fmt: skip
QUICK = Size(batch=4, mean=32, hidden=64, layers=2, heads=4, intermediate=256, vocab=256,
             window=16)  # fmt: skip


def make_config(family: str, size: Size) -> Any:
    """The family's config at ``size``, every other field (dropout included) its default."""
    import transformers as tf

    h, n, a, f, v = size.hidden, size.layers, size.heads, size.intermediate, size.vocab
    positions = 4 * 128 + 16  # every family's absolute positions cover the longest sample
    if family == "bert":
        return tf.BertConfig(vocab_size=v, hidden_size=h, num_hidden_layers=n,
                             num_attention_heads=a, intermediate_size=f,
                             max_position_embeddings=positions)  # fmt: skip
    if family == "esm":  # ESM-2's settings: rotary positions, token dropout
        return tf.EsmConfig(vocab_size=v, hidden_size=h, num_hidden_layers=n,
                            num_attention_heads=a, intermediate_size=f, pad_token_id=1,
                            mask_token_id=3, position_embedding_type="rotary",
                            token_dropout=True, emb_layer_norm_before=False,
                            max_position_embeddings=positions)  # fmt: skip
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=v, n_embd=h, n_layer=n, n_head=a, n_inner=f,
                             n_positions=positions, bos_token_id=1,
                             eos_token_id=2)  # fmt: skip
    common = {"vocab_size": v, "hidden_size": h, "num_hidden_layers": n}
    common |= {"num_attention_heads": a, "intermediate_size": f}
    if family in ("llama", "qwen2", "mistral"):
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}
        special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        config = cls[family](num_key_value_heads=a, **common, **special)
        if family == "mistral":  # the default (4096) never binds at these lengths
            config.sliding_window = size.window
        return config
    if family == "modernbert":
        return tf.ModernBertConfig(**common, local_attention=2 * size.window, pad_token_id=0,
                                   bos_token_id=1, cls_token_id=1, eos_token_id=2,
                                   sep_token_id=2)  # fmt: skip
    if family == "deberta_v2":  # DeBERTa-v3's settings
        return tf.DebertaV2Config(**common, max_position_embeddings=positions,
                                  relative_attention=True, max_relative_positions=-1,
                                  position_buckets=256, norm_rel_ebd="layer_norm",
                                  share_att_key=True, pos_att_type=["p2c", "c2p"],
                                  position_biased_input=False, layer_norm_eps=1e-7,
                                  type_vocab_size=0)  # fmt: skip
    if family == "t5":
        return tf.T5Config(vocab_size=v, d_model=h, num_layers=n, num_heads=a,
                           d_kv=h // a, d_ff=f)  # fmt: skip
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def make_model(family: str, size: Size, seed: int = 0) -> Any:
    """The base model (no pooler, no head), random weights, float32, ``train()``."""
    import transformers as tf

    config = make_config(family, size)
    torch.manual_seed(seed)
    if family == "bert":
        model = tf.BertModel(config, add_pooling_layer=False)
    elif family == "esm":
        model = tf.EsmModel(config, add_pooling_layer=False)
    elif family == "t5":
        model = tf.T5EncoderModel(config)
    else:
        model = tf.AutoModel.from_config(config)
    # norm scales and biases start as ones and zeros; then a final norm's outputs have a
    # sum of squares of about N * hidden whatever its input, and the loss (and the check)
    # would not see the model. Moved off them, as training moves them.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.train()


def make_batch(lengths: list[int], model: Any, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Right-padded ``(input_ids, attention_mask)``: ids in ``[4, vocab)`` (no special
    token), padding filled with the config's ``pad_token_id`` (0 without one)."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).to(torch.int64)
    ids = torch.randint(4, model.config.vocab_size, mask.shape, generator=gen)
    pad = model.config.pad_token_id
    return ids.masked_fill(mask == 0, 0 if pad is None else pad), mask


def hidden_states(family: str, model: Any, ids: Tensor, mask: Tensor) -> dict[str, Callable]:
    """Each system's last hidden states of the real tokens, ``[T, hidden]`` in token order."""
    extra = {"use_cache": False} if family in DECODERS else {}
    tokens = raggedfn.from_padded(ids, mask=mask)
    packed_ids = tokens.values[None]
    position = {} if family == "t5" else {"position_ids": raggedfn.positions(tokens).values[None]}
    real = mask.bool()

    def padded() -> Tensor:
        return model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state[real]

    def packed() -> Tensor:
        return model(input_ids=packed_ids, **position, **extra).last_hidden_state[0]

    def one(t: Tensor) -> Tensor:
        return model(input_ids=t[None], **extra).last_hidden_state[0]

    def mapped() -> Tensor:
        return raggedfn.map(one, tokens).values

    return {"padded": padded, "packed": packed, "map": mapped, "_one": one, "_tokens": tokens}


def loss_of(hidden: Tensor) -> Tensor:
    """The training loss: sum of squares of the real tokens' hidden states."""
    return hidden.square().sum()


def check(family: str, size: Size) -> dict[str, Any]:
    """Every system once in float64 with dropout off (``eval()``): each one's loss and the
    largest difference of its hidden states to ``padded``'s."""
    model = make_model(family, size).double().eval()
    ids, mask = make_batch(size.lengths, model)
    fns = hidden_states(family, model, ids, mask)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # map's per-sample fallback warns once
        out = {name: fns[name]() for name in SYSTEMS}
    want = out["padded"]
    return {
        "loss": {name: float(loss_of(h)) for name, h in out.items()},
        "max_error": {name: float((h - want).abs().max()) for name, h in out.items()},
    }


def _apart(checked: dict[str, Any]) -> bool:
    """Whether HF's packed input gave the padded model's hidden states (float64)."""
    return bool(checked["max_error"]["packed"] < AGREE)


def _step(model: Any, fn: Callable[[], Tensor]) -> Callable[[], float]:
    def run() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_of(fn()).backward()
        return time.perf_counter() - start

    return run


def measure(family: str, size: Size, rounds: int) -> dict[str, Any]:
    """One family's record: the float64 check, map's report, and the timed rounds."""
    checked = check(family, size)
    model = make_model(family, size)
    ids, mask = make_batch(size.lengths, model)
    fns = hidden_states(family, model, ids, mask)
    report = raggedfn.map_report(fns["_one"], fns["_tokens"])
    packed_apart = _apart(checked)
    cell: dict[str, Any] = {
        "flop_ideal": flop_ideal(family, model, size.lengths),
        "attention": model.config._attn_implementation,
        "dropout": _dropout_of(model.config),
        "check_float64_eval": checked,
        "packed_keeps_sequences_apart": packed_apart,
        "packed_note": PACKED_NOTES[family],
        "map_fully_batched": report.fully_batched,
        "map_fallback": dict(sorted(report.fallback.items())),
        "map_whole_loop": report.whole_loop,
        "map_partial_loop": report.partial_loop,
    }
    if checked["max_error"]["map"] >= AGREE:  # never time a wrong computation
        cell["status"] = f"wrong: map differs from padded by {checked['max_error']['map']:.3g}"
        return cell
    runs = {name: _step(model, fns[name]) for name in SYSTEMS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # map's per-sample fallback warns once
        for run in runs.values():  # warm-up: map's trace, the allocator's first buffers
            run()
        timed = rotated_rounds(runs, rounds, ours="map")
    over = timed["raggedfn_over"]
    cell.update(
        status="ok",
        median_ms=timed["median_ms"],
        # median of per-round ratios other / map (above 1: map faster)
        map_over_padded=1 / over["padded"],
        map_over_packed=1 / over["packed"],
    )
    cell["meets_targets"] = {name: cell[name] >= target for name, target in TARGETS.items()} | {
        "map_over_packed_counts": packed_apart
    }
    return cell


def _dropout_of(config: Any) -> dict[str, float]:
    """The config's dropout probabilities (fields named ``*drop*``), as built."""
    return {
        k: float(v)
        for k, v in sorted(config.to_dict().items())
        if "drop" in k and isinstance(v, int | float) and not isinstance(v, bool)
    }


def ideal(lengths: list[int]) -> dict[str, float]:
    """What saving the padding (or the packed row's cross-sequence attention) could give."""
    batch, longest, total = len(lengths), max(lengths), sum(lengths)
    squares = sum(n * n for n in lengths)
    return {
        "real_tokens": total,
        "padded_tokens": batch * longest,
        # padded / real work: token-wise layers, then attention pairs
        "tokens_over_padded": batch * longest / total,
        "pairs_over_padded": batch * longest**2 / squares,
        # the packed row attends over all T^2 pairs (masked or not) with SDPA's dense mask
        "pairs_over_packed": total**2 / squares,
    }


def flop_ideal(family: str, model: Any, lengths: list[int]) -> dict[str, float]:
    """The matmul-FLOP ratios of the three systems: the speedup over padded and over the
    packed row that ``map`` would reach if time followed the matrix products alone.

    Per token: one multiply-add per weight of every linear layer (``nn.Linear`` and
    transformers' ``Conv1D``), plus for DeBERTa-v2 its two products with the relative
    position keys (``2 * 2 * position_buckets * hidden`` per layer: c2p and p2c against
    the ``2 * buckets`` relative embeddings). Per (query, key) pair: ``2 * hidden`` per
    layer (scores and the weighted sum of values). Padded does ``B * N_max`` tokens and
    ``B * N_max^2`` pairs, the packed row ``T`` tokens and ``T^2`` pairs (its mask hides
    pairs, SDPA still computes them), map ``T`` tokens and ``sum N_i^2`` pairs. The
    backward's products are twice the forward's for both terms, so the ratios hold for
    the whole step; elementwise work (norms, softmax, dropout, masks) is not counted.
    """
    from transformers.pytorch_utils import Conv1D

    config = model.config
    hidden = getattr(config, "hidden_size", None) or config.d_model
    layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    per_token = float(
        sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear | Conv1D))
    )
    if family == "deberta_v2":
        per_token += layers * 2 * 2 * config.position_buckets * hidden
    per_pair = 2.0 * hidden * layers
    batch, longest, total = len(lengths), max(lengths), sum(lengths)
    squares = sum(n * n for n in lengths)
    mapped = total * per_token + squares * per_pair
    return {
        "map_over_padded": (batch * longest * per_token + batch * longest**2 * per_pair) / mapped,
        "map_over_packed": (total * per_token + total**2 * per_pair) / mapped,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    size = QUICK if args.quick else FULL
    if args.batch:
        size = dataclasses.replace(size, batch=args.batch)
    lengths = size.lengths
    record: dict[str, Any] = {
        **header("hf_train", args),
        "quick": args.quick,
        "size": dataclasses.asdict(size),
        "lengths": lengths,
        "ideal": ideal(lengths),
        "rounds": args.rounds,
        "targets": TARGETS,
        "systems": list(SYSTEMS),
        "families": {},
    }
    if args.check:
        record["check_only"] = True
    for family in args.family:
        started = time.perf_counter()
        if args.check:
            cell = {"status": "checked", "check_float64_eval": check(family, size)}
            cell["packed_keeps_sequences_apart"] = _apart(cell["check_float64_eval"])
        else:
            cell = measure(family, size, args.rounds)
        cell["seconds"] = round(time.perf_counter() - started, 1)
        record["families"][family] = cell
    return record


def check_markdown(record: dict[str, Any]) -> str:
    """The ``--check`` table: float64, dropout off, every system against ``padded``."""
    lines = [
        "float64, eval mode: each system's loss and largest hidden-state difference to padded",
        "",
        "| family | padded loss | packed loss | map loss | packed error | map error |",
        "|---|---|---|---|---|---|",
    ]
    for family, c in record["families"].items():
        loss, err = c["check_float64_eval"]["loss"], c["check_float64_eval"]["max_error"]
        lines.append(
            f"| {family} | {loss['padded']:.12g} | {loss['packed']:.12g} | {loss['map']:.12g} | "
            f"{err['packed']:.2g} | {err['map']:.2g} |"
        )
    return "\n".join(lines)


def markdown(record: dict[str, Any]) -> str:
    if record.get("check_only"):
        return check_markdown(record)
    s, ideal_ = record["size"], record["ideal"]
    lines = [
        f"One training step (forward + backward, train mode, default dropout), hidden "
        f"{s['hidden']}, {s['layers']} layers, {s['heads']} heads, intermediate "
        f"{s['intermediate']}, vocabulary {s['vocab']}, float32, B = {s['batch']}, lengths "
        f"{record['lengths']} ({ideal_['real_tokens']} real of {ideal_['padded_tokens']} "
        f"padded tokens: ideal {ideal_['tokens_over_padded']:.2f}x over padded for token-wise "
        f"layers, {ideal_['pairs_over_padded']:.2f}x for attention pairs; "
        f"{ideal_['pairs_over_packed']:.2f}x over the packed row's attention), "
        f"{record['threads']} thread(s), median of {record['rounds']} rounds",
        "",
        "| family | padded ms | packed ms | map ms | map over padded | map over packed "
        "| FLOP ideal over padded / packed "
        "| packed keeps sequences apart (float64 error) | map fully batched |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for family, c in record["families"].items():
        err = c["check_float64_eval"]["max_error"]["packed"]
        apart = f"{'yes' if c['packed_keeps_sequences_apart'] else 'NO'} ({err:.2g})"
        batched = "yes" if c["map_fully_batched"] else "no"
        flops = c.get("flop_ideal")
        ideal_cell = (
            f"{flops['map_over_padded']:.2f}x / {flops['map_over_packed']:.2f}x" if flops else ""
        )
        if c["status"] != "ok":
            lines.append(
                f"| {family} | | | | {c['status']} | | {ideal_cell} | {apart} | {batched} |"
            )
            continue
        ms = c["median_ms"]
        lines.append(
            f"| {family} | {ms['padded']:.1f} | {ms['packed']:.1f} | {ms['map']:.1f} | "
            f"{c['map_over_padded']:.2f}x | {c['map_over_packed']:.2f}x"
            f"{'' if c['packed_keeps_sequences_apart'] else ' (packed mixes)'} | "
            f"{ideal_cell} | {apart} | {batched} |"
        )
        if not c["map_fully_batched"]:
            why = [c["map_whole_loop"] or c["map_partial_loop"] or ""]
            why += [f"{op} ({r})" for op, r in c["map_fallback"].items()]
            notes.append(f"- {family}: map ran per sample: {', '.join(w for w in why if w)}")
    t = record["targets"]
    met = [
        f for f, c in record["families"].items()
        if c["status"] == "ok" and all(c["meets_targets"][k] for k in t)
    ]  # fmt: skip
    lines += [
        "",
        f"Targets: map >= {t['map_over_padded']:g}x over padded and >= "
        f"{t['map_over_packed']:g}x over packed; met by {', '.join(met) or 'none'} "
        f"of {', '.join(record['families'])}.",
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B 4, mean length 32, hidden 64")
    parser.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--batch", type=int, default=None, help="override B")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--check",
        action="store_true",
        help="only the float64 eval-mode check: each system's loss and error vs padded",
    )
    return cli(parser, run, markdown, argv, plot=plots.plot_hf_train)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
