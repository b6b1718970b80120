"""Every committed benchmark record has its plot, and ``benchmarks.plots`` can redraw it.

docs/benchmarks.md links one plot per workload; these tests keep a record
from landing without one and check that the plotter of every record kind still reads
the records as they are written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import plots

RESULTS = plots.RESULTS


def _records() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


def test_every_committed_record_has_a_plotter_and_a_plot() -> None:
    records = _records()
    assert len(records) >= 10
    for path in records:
        assert plots.plotter_for(path) is not None, f"no plotter for {path.relative_to(RESULTS)}"
        assert path.with_suffix(".png").exists(), f"{path.relative_to(RESULTS)} has no plot"


def test_plots_redraws_every_record(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    copy = tmp_path / "results"
    for path in _records():
        target = copy / path.relative_to(RESULTS)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    assert plots.main(["--results", str(copy)]) == 0
    for path in copy.rglob("*.json"):
        png = path.with_suffix(".png")
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_standalone_plotters_read_what_the_scripts_write(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pair_state = {"rows": [{"batch": 8, "mode": "fwd", "loop_over": {"loop": 1.0, "map": 1.3}}]}
    assert plots.plot_pair_state(pair_state, tmp_path / "p.png")
    record = json.loads((RESULTS / "nested" / "moe.json").read_text())
    assert plots.plot_moe(record, tmp_path / "m.png")
    assert not plots.write_bars(tmp_path / "empty.png", "t", {}, "y")
    assert not (tmp_path / "empty.png").exists()


def test_a_standalone_run_writes_its_plot_next_to_its_record(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import moe

    out = tmp_path / "moe.json"
    moe.main(
        ["--tokens", "64", "--experts", "4", "--dim", "8", "--rounds", "1", "--json", str(out)]
    )
    assert json.loads(out.read_text())["modes"]
    assert out.with_suffix(".png").exists()


@pytest.mark.parametrize(
    ("module", "argv", "field"),
    [
        ("map_bert", ["--quick", "--batch", "3", "--repeats", "1", "--no-compile"], "over"),
        ("map_retrace", ["--steps", "4", "--bert-steps", "2", "--rounds", "2"], "rows"),
        ("bert_full", ["--scale", "tiny", "--batch", "2", "--rounds", "1"], "scales"),
    ],
)
def test_the_map_and_full_bert_scripts_write_a_record_and_its_plot(
    tmp_path: Path, module: str, argv: list[str], field: str
) -> None:
    pytest.importorskip("matplotlib")
    import importlib

    script = importlib.import_module(f"benchmarks.{module}")
    out = tmp_path / "results" / module / f"{module}-quick.json"
    out.parent.mkdir(parents=True)
    returned = script.main([*argv, "--json", str(out), "--markdown", str(tmp_path / "t.md")])
    record = json.loads(out.read_text())
    assert record == json.loads(json.dumps(returned)) and record[field]
    assert record["command"].startswith(f"python -m benchmarks.{module} ")
    assert plots.plotter_for(out, tmp_path / "results") is getattr(plots, f"plot_{module}")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "t.md").read_text().count("\n|") >= 2  # the table
