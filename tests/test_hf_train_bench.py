"""benchmarks/hf_train.py: a quick run writes a complete record, and its float64 check
agrees with the per-sample loop (so the systems it times compute the same loss)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import hf_train

# an encoder whose packed input keeps sequences apart, a decoder, and T5 (whose does not)
FAMILIES = ("bert", "llama", "t5")
SIZE = dataclasses.replace(hf_train.QUICK, batch=3)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_train") / "hf_train-quick.json"
    argv = ["--quick", "--batch", "3", "--rounds", "1", "--family", *FAMILIES]
    written = hf_train.main([*argv, "--json", str(out), "--markdown", str(out.with_suffix(".md"))])
    return {**written, "_path": out}


def loop_loss(family: str) -> float:
    """The loss of the float64, eval-mode model run on each sequence alone."""
    model = hf_train.make_model(family, SIZE).double().eval()
    ids, mask = hf_train.make_batch(SIZE.lengths, model)
    extra = {"use_cache": False} if family in hf_train.DECODERS else {}
    with torch.no_grad():
        return sum(
            float(model(input_ids=row[m.bool()][None], **extra).last_hidden_state.square().sum())
            for row, m in zip(ids, mask, strict=True)
        )


def test_the_record_has_every_family_system_and_ratio(record):
    assert list(record["families"]) == list(FAMILIES)
    assert record["lengths"] == SIZE.lengths
    assert record["systems"] == ["padded", "packed", "map"]
    assert record["targets"] == {"map_over_padded": 4.0, "map_over_packed": 2.0}
    lengths = record["lengths"]
    assert len(lengths) == 3 and record["size"]["batch"] == 3
    ideal = record["ideal"]
    assert ideal["real_tokens"] == sum(lengths)
    assert ideal["tokens_over_padded"] == 3 * max(lengths) / sum(lengths)
    for family, cell in record["families"].items():
        assert cell["status"] == "ok", (family, cell["status"])
        assert set(cell["median_ms"]) == {"padded", "packed", "map"}
        assert all(ms > 0 for ms in cell["median_ms"].values())
        assert cell["map_over_padded"] > 0 and cell["map_over_packed"] > 0
        assert set(cell["meets_targets"]) >= {"map_over_padded", "map_over_packed"}
        assert isinstance(cell["map_fully_batched"], bool)
        assert cell["map_fully_batched"] == (
            not cell["map_fallback"] and cell["map_whole_loop"] is None
        )
        assert cell["dropout"], family  # train mode with the config's own dropout
    assert record["families"]["llama"]["map_fully_batched"]
    # the record on disk is what main returned, with its table and plot
    on_disk = record["_path"]
    assert json.loads(on_disk.read_text())["families"].keys() == record["families"].keys()
    table = on_disk.with_suffix(".md").read_text()
    assert all(f"| {family} |" in table for family in FAMILIES) and "(packed mixes)" in table
    if importlib.util.find_spec("matplotlib"):
        assert on_disk.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_packed_is_marked_where_it_mixes_sequences(record):
    apart = {f: c["packed_keeps_sequences_apart"] for f, c in record["families"].items()}
    assert apart == {"bert": True, "llama": True, "t5": False}
    t5 = record["families"]["t5"]["check_float64_eval"]["max_error"]["packed"]
    assert t5 > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_the_three_losses_agree_with_the_per_sample_loop_in_float64(record, family):
    checked = record["families"][family]["check_float64_eval"]
    want = loop_loss(family)
    loss = checked["loss"]
    assert loss["padded"] == pytest.approx(want, rel=1e-12, abs=0)
    assert loss["map"] == pytest.approx(want, rel=1e-12, abs=0)
    assert checked["max_error"]["map"] < 1e-10
    if record["families"][family]["packed_keeps_sequences_apart"]:
        assert loss["packed"] == pytest.approx(want, rel=1e-12, abs=0)
    else:  # the mixed sequences move the loss: the check sees it
        assert abs(loss["packed"] - want) > 1e-6 * want


def test_the_loss_sees_the_model():
    # with unit norm scales a final norm's sum of squares is about N * hidden whatever
    # its input; make_model moves them so the check compares something
    model = hf_train.make_model("bert", SIZE).double().eval()
    ids, mask = hf_train.make_batch(SIZE.lengths, model)
    fns = hf_train.hidden_states("bert", model, ids, mask)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = float(hf_train.loss_of(fns["padded"]()))
        model.embeddings.word_embeddings.weight.mul_(1.5)
        after = float(hf_train.loss_of(fns["padded"]()))
    assert abs(after - before) > 1e-3 * before


@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
def test_flop_ideal_counts_the_linear_layers_and_the_attention_pairs(family):
    """The FLOP ideal against the layer shapes written out: BERT and GPT-2 have four
    ``h x h`` projections and two ``h x f`` MLP matrices per layer, Llama three MLP
    matrices (gated); GPT-2's ``Conv1D`` layers count as linear ones."""
    size = hf_train.QUICK
    h, f, layers = size.hidden, size.intermediate, size.layers
    model = hf_train.make_model(family, size)
    per_token = layers * (4 * h * h + (3 if family == "llama" else 2) * h * f)
    per_pair = 2 * h * layers
    lengths = [3, 1, 6]
    mapped = 10 * per_token + (9 + 1 + 36) * per_pair
    got = hf_train.flop_ideal(family, model, lengths)
    assert got["map_over_padded"] == pytest.approx((18 * per_token + 108 * per_pair) / mapped)
    assert got["map_over_packed"] == pytest.approx((10 * per_token + 100 * per_pair) / mapped)
