"""benchmarks/bert_floor.py and benchmarks/compiled_layer.py run at tiny sizes and check
the systems they time against each other first."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import _systems, bert_floor, compiled_layer

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def test_floor_prints_one_row_per_scale_after_checking_the_systems(capsys):
    rows = bert_floor.main(["--quick", "--workload", "tiny", "--rounds", "1"])
    assert len(rows) == 1 and rows[0].startswith("| tiny | 8 |"), rows
    assert "raggedfn / dense@T" in capsys.readouterr().out


def test_floor_refuses_a_wrong_system(monkeypatch):
    build = _systems.SYSTEMS["raggedfn"]

    def wrong(case, model):
        step = build(case, model)
        collect = step.collect
        return _systems.Step(step.run, lambda out: [t + 1 for t in collect(out)])

    monkeypatch.setitem(_systems.SYSTEMS, "raggedfn", wrong)
    with pytest.raises(AssertionError, match="tiny raggedfn"):
        bert_floor.main(["--quick", "--workload", "tiny", "--rounds", "1"])


def test_compiled_layer_checks_and_times_every_system_with_one_graph_each():
    torch._dynamo.reset()
    args = ["--scale", "tiny", "--batch", "3", "--length-scale", "0.1", "--rounds", "1"]
    record = compiled_layer.main([*args, "--backend", "eager"])
    names = {"map", "raggedfn", "padded"}
    assert set(record["median_ms"]) == names | {f"{name} compiled" for name in names}
    assert set(record["compiled_over_eager"]) == names
    assert set(record["first_call_s"]) == names
    assert record["graphs"] == {"map": 1, "raggedfn": 1, "padded": 1}  # fullgraph, no recompile


def test_compiled_layer_runs_the_systems_asked_for_and_checks_the_padded_one(monkeypatch):
    torch._dynamo.reset()
    args = ["--scale", "tiny", "--batch", "3", "--length-scale", "0.1", "--rounds", "1"]
    record = compiled_layer.main([*args, "--backend", "eager", "--systems", "padded"])
    assert set(record["median_ms"]) == {"padded", "padded compiled"}
    assert record["systems"] == ["padded"]

    real = compiled_layer.bert.layer_batched

    def wrong(x, p, heads, mask):  # the padded keys not masked
        return real(x, p, heads, None)

    monkeypatch.setattr(compiled_layer.bert, "layer_batched", wrong)
    torch._dynamo.reset()
    with pytest.raises(AssertionError):
        compiled_layer.main([*args, "--backend", "eager", "--systems", "padded"])


def _record(system: str, ratio: float, lengths: list[int]) -> dict:
    return {
        "scale": "tiny",
        "lengths": lengths,
        "threads": 1,
        "backend": "inductor",
        "systems": [system],
        "first_call_s": {system: 20.0},
        "graphs": {system: 1},
        "compile_phases_s": {system: {"total": 20.0}},
        "compiled_over_eager": {system: {"median_of_ratios": ratio, "ratio_of_minima": ratio}},
        "median_ms": {system: 2.0, f"{system} compiled": 2.0 / ratio},
        "min_ms": {system: 1.0, f"{system} compiled": 1.0 / ratio},
    }


def test_compiled_layer_records_of_one_case_merge_by_system(tmp_path):
    path = tmp_path / "compiled_layer-tiny.json"
    compiled_layer.write(_record("padded", 0.9, [3, 5]), path)
    compiled_layer.write(_record("map", 1.1, [3, 5]), path)
    compiled_layer.write(_record("map", 1.2, [3, 5]), path)  # a rerun replaces its run
    record = json.loads(path.read_text())
    assert record["systems"] == ["padded", "map"] and len(record["runs"]) == 2
    assert record["compiled_over_eager"]["padded"]["median_of_ratios"] == 0.9
    assert record["compiled_over_eager"]["map"]["median_of_ratios"] == 1.2
    assert set(record["median_ms"]) == {"padded", "padded compiled", "map", "map compiled"}
    compiled_layer.write(_record("raggedfn", 0.8, [4, 4]), path)  # another case: replaced
    assert json.loads(path.read_text())["systems"] == ["raggedfn"]
    pytest.importorskip("matplotlib")
    assert path.with_suffix(".png").exists()
