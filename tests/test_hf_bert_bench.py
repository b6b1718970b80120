"""benchmarks/hf_bert.py: runs at a tiny size, checks agreement first, prints one row per system."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

pytest.importorskip("transformers")

from benchmarks import hf_bert


def test_prints_a_row_per_system_and_the_packed_path_error(capsys):
    args = ["--layers", "1", "--hidden", "32", "--heads", "4", "--batch", "3"]
    record = hf_bert.main([*args, "--max-len", "16", "--rounds", "1", "--no-compiled"])
    out = capsys.readouterr().out
    for name in ("padded", "map", "map+ids"):
        assert f"| {name} |" in out, out
    assert record["map_ids_fallback"] == []  # positions and token types passed in
    import transformers

    if Version(transformers.__version__) >= Version("5.25"):
        # create_bidirectional_mask reads packed position_ids since 5.25: HF's packed path
        # keeps the sequences apart, as the padded model does
        assert record["hf_packed_max_error"] < 1e-4
    else:
        assert record["hf_packed_max_error"] > 1e-3  # BERT's packed path mixes sequences here
    lengths = torch.tensor(record["lengths"])
    assert record["occupancy_tokens"] == float(lengths.sum()) / (3 * int(lengths.max()))


def test_lengths_give_about_a_quarter_occupancy_at_the_default_size():
    lengths = hf_bert.make_lengths(8, 256)
    assert int(lengths.max()) == 256 and int(lengths.min()) >= 8
    assert 0.2 < float(lengths.sum()) / (8 * 256) < 0.3


def test_agreement_check_catches_a_wrong_system():
    torch.manual_seed(0)
    want = torch.randn(5, 3)
    fns = {"padded": lambda: want, "map": lambda: want.clone()}
    hf_bert.check_agreement(fns)
    fns["map"] = lambda: want + 1e-2
    with pytest.raises(AssertionError):
        hf_bert.check_agreement(fns)


def test_compiled_systems_equal_the_padded_model():
    # aot_eager: the compiled graphs and their backward without inductor's codegen
    model = hf_bert.make_model(1, hidden=32, heads=4)
    ids, mask = hf_bert.make_batch(torch.tensor([16, 5, 9]))
    want = hf_bert.systems(model, ids, mask)["padded"]
    hf_bert.systems(model, ids, mask)["map+ids"]()  # map traces eagerly first
    hf_bert.systems(model, ids, mask)["map"]()
    compiled = hf_bert.compiled_systems(model, ids, mask, backend="aot_eager")
    assert list(compiled) == ["padded compiled", "map compiled", "map+ids compiled"]
    hf_bert.check_agreement({"padded": want, **compiled})
    cotangent = torch.randn(30, 32)
    grads = {}
    for name, fn in {"padded": want, **compiled}.items():
        hf_bert.step(model, fn, cotangent)
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for name in compiled:
        for got, expected in zip(grads[name], grads["padded"], strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_compiles_only_the_systems_asked_for():
    torch._dynamo.reset()
    args = ["--layers", "1", "--hidden", "32", "--heads", "4", "--batch", "3", "--max-len", "16"]
    record = hf_bert.main([*args, "--rounds", "1", "--backend", "aot_eager", "--compile", "map"])
    assert set(record["compile_seconds"]) == {"map compiled"}
    assert set(record["compiled_over_eager"]) == {"map compiled"}
    assert set(record["median_ms"]) == {"padded", "map", "map+ids", "map compiled"}
