"""benchmarks/compile_guards.py: the guard counts of a compiled HF BERT step, padded
and through map, at a tiny size; the record has every field the table reads."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks import compile_guards

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def test_compile_guards_record(tmp_path):
    out = tmp_path / "guards.json"
    argv = ["--layers", "1", "--hidden", "16", "--batch", "3", "--repeats", "2"]
    record = compile_guards.main([*argv, "--backend", "eager", "--json", str(out)])
    assert out.exists()
    assert set(record["rows"]) == {"padded", "map", "map functional"}
    for row in record["rows"].values():
        assert row["guards"] > 0 and row["lines"] >= row["guards"] and row["nodes"] > 0
        assert row["check_us"] > 0 and row["step_ms"] > 0 and row["compile_s"] > 0
        assert sum(row["by_root"].values()) <= row["guards"]
        assert row["by_kind"] and row["top_sources"]
    padded, mapped = record["rows"]["padded"], record["rows"]["map"]
    assert set(record["added_over_padded"]) == {"map", "map functional"}
    # map's own cache, plans and check constants add no guard: what it adds over the
    # padded model is the check of the module's state (before: 17x padded at 2 layers)
    assert mapped["guards"] < 6 * padded["guards"], (mapped["guards"], padded["guards"])
    # per module of the model, what the check of its state costs: its type, one guard
    # per parameter / buffer / submodule dict (their length), one per scalar attribute
    # (its value, which dynamo compares by type too), and its tensors (18.4 per module
    # with a type guard beside each dict's and each number's value guard)
    modules = len(list(compile_guards.make_model(1, 16).modules()))
    model_guards = mapped["by_root"]["L['model']"]
    assert model_guards < 15 * modules, (model_guards, modules)
    functional = record["rows"]["map functional"]["by_root"]["L['one']"]
    assert functional < 15 * modules, (functional, modules)
    assert "leaf guards" in compile_guards.markdown(record)
