"""A zoo of Hugging Face families (2 layers, built from configs, float64) through ``raggedfn.map``.

For every family the model runs on ONE sequence of ids inside ``raggedfn.map`` over
``raggedfn.from_padded(input_ids, mask=attention_mask)`` and must equal the same
model on the padded batch with its ``attention_mask``: the real tokens' hidden
states and the gradients of a training-like loss with respect to every parameter
(< 1e-10, eval mode, every dropout probability of the config set to 0), for right-
and left-padded batches, decoders with ``use_cache=True`` and ``use_cache=False``
in the per-sample call.

Whether each runs *fully batched* (no per-sample loop for any op) is a separate
test: eval mode and train mode (the config's default dropout, which cannot be
exact, so there the call must only run). The cases that still fall back are strict
xfails naming the fallback, so a new batching rule turns them into failures until
the mark is removed. Models are built once per module (``functools.cache``).
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

VOCAB, HIDDEN, HEADS, LAYERS, FFN = 64, 32, 4, 2, 64
LENGTHS = [5, 9, 3]
TOLERANCE = {"atol": 1e-10, "rtol": 0.0}
# Gemma's RMSNorm computes in float32 whatever the model's dtype (``x.float()``,
# ``1.0 + weight.float()``): its weight's gradient is a float32 sum over the tokens,
# whose order differs between the padded model, the per-sample loop and ``map``
# (1e-6 apart, all three pairs); values stay bit-identical (float32 per row)
FLOAT32_GRADS = {"gemma": "norm.weight", "gemma3": "norm.weight"}
FLOAT32_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}

ENCODERS = (
    "bert", "roberta", "distilbert", "albert", "electra", "mpnet", "xlm_roberta",
    "deberta_v2", "esm", "modernbert", "t5_encoder",
)  # fmt: skip
DECODERS = (
    "gpt2", "gpt_neox", "opt", "falcon", "llama", "llama_gqa", "qwen2", "qwen3", "mistral",
    "gemma", "gemma3", "phi3",
)  # fmt: skip
FAMILIES = ENCODERS + DECODERS

# the position ids a left-padded batch needs: positions counted from the first real
# token. RoBERTa, XLM-R and MPNet count them from the padding id themselves; T5's and
# DeBERTa's relative positions are integer differences; rotary angles are not shift
# invariant in rounding (HF computes them in float32: ESM's left-padded batch without
# them differs from the per-sample model by 7e-10)
NEEDS_POSITIONS = ("bert", "distilbert", "albert", "electra", "esm", "modernbert", *DECODERS)


def _bert_like(cls: Any, dropout: bool, **extra: Any) -> Any:
    config = cls(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64, **extra,
    )  # fmt: skip
    if not dropout:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    return config


def _decoder(cls: Any, **extra: Any) -> Any:
    common = {
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "intermediate_size": FFN, "max_position_embeddings": 64,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }  # fmt: skip
    return cls(**(common | extra))


def _config(name: str, dropout: bool) -> Any:
    """A 2-layer config of the family ``name``; ``dropout=False`` sets every dropout to 0."""
    t = transformers
    if name in ("bert", "electra"):
        cls = t.BertConfig if name == "bert" else t.ElectraConfig
        extra = {} if name == "bert" else {"embedding_size": 16}
        config = _bert_like(cls, dropout, pad_token_id=0, **extra)
    elif name in ("roberta", "xlm_roberta", "mpnet"):
        # positions start after the padding id: 2 more slots
        cls = {"roberta": t.RobertaConfig, "xlm_roberta": t.XLMRobertaConfig}.get(
            name, t.MPNetConfig
        )
        config = _bert_like(cls, dropout, pad_token_id=1)
        config.max_position_embeddings = 66  # (MPNet's relative buckets are fixed: 32)
    elif name == "albert":
        config = _bert_like(t.AlbertConfig, dropout, embedding_size=16, pad_token_id=0)
    elif name == "distilbert":
        config = t.DistilBertConfig(
            vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
            max_position_embeddings=64, pad_token_id=0,
        )  # fmt: skip
        if not dropout:
            config.dropout = config.attention_dropout = 0.0
    elif name == "deberta_v2":  # DeBERTa-v3's settings
        config = _bert_like(
            t.DebertaV2Config, dropout, relative_attention=True, position_buckets=8,
            pos_att_type=["p2c", "c2p"], max_relative_positions=-1, norm_rel_ebd="layer_norm",
            share_att_key=True, position_biased_input=False, pad_token_id=0,
        )  # fmt: skip
    elif name == "esm":  # ESM-2's settings: rotary positions, token dropout scaling
        config = _bert_like(
            t.EsmConfig, dropout, position_embedding_type="rotary", token_dropout=True,
            emb_layer_norm_before=False, pad_token_id=1, mask_token_id=2,
        )  # fmt: skip
    elif name == "modernbert":  # a global layer, then a local one (window 4)
        config = t.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
            global_attn_every_n_layers=2, local_attention=4, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        )  # fmt: skip
        if not dropout:
            config.attention_dropout = config.embedding_dropout = config.mlp_dropout = 0.0
    elif name == "t5_encoder":
        config = t.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
            num_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, pad_token_id=0,
        )  # fmt: skip
        if not dropout:
            config.dropout_rate = 0.0
    elif name == "gpt2":
        config = t.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if not dropout:
            config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    elif name == "gpt_neox":
        config = _decoder(t.GPTNeoXConfig, rotary_pct=0.5)
        if not dropout:
            config.attention_dropout = config.hidden_dropout = 0.0
    elif name == "opt":
        config = t.OPTConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=FFN,
            num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=HIDDEN,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if not dropout:
            config.dropout = config.attention_dropout = config.activation_dropout = 0.0
    elif name == "falcon":  # multi-query attention, rotary positions (the defaults)
        config = t.FalconConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if not dropout:
            config.attention_dropout = config.hidden_dropout = 0.0
    elif name in ("llama", "llama_gqa"):
        config = _decoder(t.LlamaConfig, num_key_value_heads=HEADS if name == "llama" else 2)
    elif name == "qwen2":
        config = _decoder(t.Qwen2Config, num_key_value_heads=2)
    elif name == "qwen3":
        config = _decoder(t.Qwen3Config, num_key_value_heads=2, head_dim=HIDDEN // HEADS)
    elif name == "mistral":  # the window (4) matters for lengths up to 9
        config = _decoder(t.MistralConfig, num_key_value_heads=2, sliding_window=4)
    elif name == "gemma":
        config = _decoder(t.GemmaConfig, num_key_value_heads=2, head_dim=HIDDEN // HEADS)
    elif name == "gemma3":  # a sliding layer (window 4), then a global one
        config = _decoder(
            t.Gemma3TextConfig, num_key_value_heads=2, head_dim=HIDDEN // HEADS,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    elif name == "phi3":
        config = _decoder(t.Phi3Config, num_key_value_heads=2)
        if not dropout:
            config.resid_pdrop = config.embd_pdrop = 0.0
    else:
        raise AssertionError(name)
    if not dropout and hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0
    return config


MODEL_CLASS = {"t5_encoder": "T5EncoderModel"}


@functools.cache
def model_of(name: str, mode: str) -> Any:
    """The family's model: ``mode="eval"`` without dropout, ``"train"`` with the default one."""
    config = _config(name, dropout=mode == "train")
    torch.manual_seed(0)
    if name in MODEL_CLASS:
        model = getattr(transformers, MODEL_CLASS[name])(config)
    else:
        model = transformers.AutoModel.from_config(config)
    model = model.double()
    return model.train() if mode == "train" else model.eval()


def pad_id(model: Any) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def batch(lengths: list[int] = LENGTHS) -> raggedfn.Ragged:
    """Token ids of the samples (none is a special id)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (sum(lengths),), generator=gen)
    return raggedfn.from_lengths(ids, lengths)


def per_sample(model: Any, use_cache: bool | None):
    """One ``[N]`` sequence of ids -> its ``[N, hidden]`` last hidden states."""
    kwargs = {} if use_cache is None else {"use_cache": use_cache}

    def f(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids[None], **kwargs).last_hidden_state[0]

    return f


def padded_batch(name: str, model: Any, side: str, lengths: list[int] = LENGTHS):
    """``(input_ids, attention_mask, keyword arguments)`` of the batch padded on ``side``."""
    ids = batch(lengths)
    input_ids, mask = pad_by_hand(raggedfn.unbind(ids), side, max(lengths), fill=pad_id(model))
    kwargs: dict[str, Any] = {"attention_mask": mask}
    if side == "left" and name in NEEDS_POSITIONS:
        kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    return input_ids, mask, kwargs


def ragged_forward(model: Any, use_cache: bool | None, input_ids, mask) -> raggedfn.Ragged:
    tokens = raggedfn.from_padded(input_ids, mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a per-sample fallback warns, by design
        return raggedfn.map(per_sample(model, use_cache), tokens)


def padded_forward(model: Any, input_ids, kwargs) -> torch.Tensor:
    """The real tokens' hidden states of the padded model, in packed order."""
    out = model(input_ids=input_ids, **kwargs).last_hidden_state
    return out[kwargs["attention_mask"].bool()]


def _cases() -> list[Any]:
    cases = []
    for name in FAMILIES:
        for side in ("right", "left"):
            for cache in (True, False) if name in DECODERS else (None,):
                tag = "" if cache is None else "-cache" if cache else "-nocache"
                cases.append(pytest.param(name, side, cache, id=f"{name}-{side}{tag}"))
    return cases


def assert_map_equals_the_padded_model(
    name: str, side: str, use_cache: bool | None, lengths: list[int] = LENGTHS
) -> None:
    """Values and gradients of ``map`` over the batch equal the padded model's."""
    model = model_of(name, "eval")
    input_ids, mask, kwargs = padded_batch(name, model, side, lengths)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(
        sum(lengths), HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )
    got = ragged_forward(model, use_cache, input_ids, mask)
    want = padded_forward(model, input_ids, kwargs)
    if side == "right" and lengths == LENGTHS:  # the same call's report, while it is cached
        mode = "eval" if use_cache is None else "eval-cache" if use_cache else "eval-nocache"
        report_of(name, mode)
    assert isinstance(got, raggedfn.Ragged) and got.lengths.tolist() == lengths
    torch.testing.assert_close(got.values, want, **TOLERANCE)
    got_grads = torch.autograd.grad((got.values * weights).sum(), params, allow_unused=True)
    want_grads = torch.autograd.grad((want * weights).sum(), params, allow_unused=True)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    for key, g, w in zip(names, got_grads, want_grads, strict=True):
        assert (g is None) == (w is None), key
        if w is not None:
            float32 = name in FLOAT32_GRADS and key.endswith(FLOAT32_GRADS[name])
            tolerance = FLOAT32_TOLERANCE if float32 else TOLERANCE
            torch.testing.assert_close(g, w, **tolerance, msg=lambda m, k=key: f"{k}: {m}")
    # the check has teeth: the loss reaches every parameter but the unused heads'
    still = [
        k for k, w in zip(names, want_grads, strict=True) if w is None or not w.abs().max() > 0
    ]
    assert all(k.startswith(UNUSED) for k in still), still


UNUSED = ("pooler.", "contact_head.")  # parameters the last hidden states do not reach


@pytest.mark.parametrize(("name", "side", "use_cache"), _cases())
def test_map_equals_the_padded_model_values_and_gradients(name, side, use_cache):
    assert_map_equals_the_padded_model(name, side, use_cache)


ONE_TOKEN_CASES = [
    ("bert", None), ("deberta_v2", None), ("modernbert", None), ("t5_encoder", None),
    ("llama_gqa", True), ("llama_gqa", False), ("mistral", True), ("gemma3", False),
]  # fmt: skip


@pytest.mark.parametrize(("name", "use_cache"), ONE_TOKEN_CASES)
def test_a_one_token_sample_equals_the_padded_model(name, use_cache):
    """A sample of one token breaks the traces' size guards (``N > 1``: transformers'
    mask code and SDPA branch on it): it gets a plan of its own or the loop."""
    assert_map_equals_the_padded_model(name, "left", use_cache, lengths=[5, 1, 9, 3])


def _batching_cases() -> list[Any]:
    cases = []
    for name in FAMILIES:
        modes = ("eval-cache", "eval-nocache") if name in DECODERS else ("eval",)
        for mode in (*modes, "train"):
            marks = []
            if (name, mode) in FALLS_BACK:
                marks = [pytest.mark.xfail(strict=True, reason=FALLS_BACK[name, mode])]
            cases.append(pytest.param(name, mode, id=f"{name}-{mode}", marks=marks))
    return cases


# (family, mode) -> why it is not fully batched today: the report's fallback (none left:
# attention dropout and masks built from positions run on the fused paths, DeBERTa-v2's
# shared ``type_as`` constant stays shared)
FALLS_BACK: dict[tuple[str, str], str] = {}
# families whose default attention is written out (softmax, dropout, matmul), no SDPA call
EAGER_ATTENTION = ("mpnet", "deberta_v2")


# map's cache keeps 16 variants of one function (here: of ``per_sample``'s code, for
# every family and mode), so the report of each eval call is taken right after the
# exactness test's call, while its trace is still cached, instead of tracing again
REPORTS: dict[tuple[str, str], Any] = {}


def report_of(name: str, mode: str) -> Any:
    """``map_report`` of the right-padded batch (``mode``: eval[-cache|-nocache] or train)."""
    if (name, mode) not in REPORTS:
        model = model_of(name, "train" if mode == "train" else "eval")
        use_cache = None if name in ENCODERS else mode != "eval-nocache"
        input_ids, mask, _ = padded_batch(name, model, "right")
        tokens = raggedfn.from_padded(input_ids, mask=mask)
        REPORTS[name, mode] = raggedfn.map_report(per_sample(model, use_cache), tokens)
    return REPORTS[name, mode]


FUSED = {
    "fused",
    "fused with a mask",
    "fused, lazy mask: causal",
    "fused, lazy mask: dropped",
    "fused, lazy mask: per sample",
}


@pytest.mark.parametrize(("name", "mode"), _batching_cases())
def test_runs_fully_batched(name, mode):
    report = report_of(name, mode)
    # every attention call on torch's kernels: masks from positions (no cache, sliding
    # windows, local layers, T5's position bias) and dropout included
    assert bool(report.attention) == (name not in EAGER_ATTENTION), report
    assert set(report.attention) <= FUSED, report.attention
    # masks built from positions stay lazy (rules/_lazy_pairs.py): none is materialized
    # (T5's position bias is read from its weights: the materialized path, as it must)
    assert ("fused with a mask" in report.attention) == (name == "t5_encoder"), report.attention
    out = report.output
    assert isinstance(out, raggedfn.Ragged) and out.lengths.tolist() == LENGTHS
    assert out.values.shape == (sum(LENGTHS), HIDDEN) and out.values.isfinite().all()
    assert report.fully_batched, str(report)


@pytest.mark.parametrize("name", ["bert", "t5_encoder"])
def test_one_token_samples_run_on_the_batched_plan(name, capfd):
    """After batches of longer samples, batches holding samples of one token run on the
    plan of the longer ones (no plan of their own, no per-sample loop), equal the loop,
    and torch prints nothing (its vmap fallback warns on stderr)."""
    model = model_of(name, "eval")
    f = per_sample(model, None)
    raggedfn.map(f, batch([5, 9, 3]))
    plans = raggedfn.map_cache_info(f).plans
    for lengths in ([1, 2], [4, 1, 6, 1]):
        ids = batch(lengths)
        report = raggedfn.map_report(f, ids)
        assert report.fully_batched, str(report)
        want = torch.cat([f(t) for t in raggedfn.unbind(ids)])
        torch.testing.assert_close(report.output.values, want, **TOLERANCE)
    assert raggedfn.map_cache_info(f).plans == plans
    assert "Warning" not in capfd.readouterr().err


@pytest.mark.parametrize(("name", "use_cache"), ONE_TOKEN_CASES)
def test_one_token_samples_run_batched(name, use_cache, capfd):
    """Families whose one-token samples take other ops (a causal flag decided by the
    length, no causal mask for one query) run them on a plan of their own, fully batched
    too: that plan's fixed-size samples are stacked, attention is one call of torch's
    kernel (no vmap fallback, nothing printed), and values equal the loop."""
    f = per_sample(model_of(name, "eval"), use_cache)
    raggedfn.map(f, batch([5, 9, 3]))
    for lengths in ([1, 2], [4, 1, 6, 1], [1]):
        ids = batch(lengths)
        report = raggedfn.map_report(f, ids)
        assert report.fully_batched, str(report)
        want = torch.cat([f(t) for t in raggedfn.unbind(ids)])
        torch.testing.assert_close(report.output.values, want, **TOLERANCE)
    assert "Warning" not in capfd.readouterr().err
