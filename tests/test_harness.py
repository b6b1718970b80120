"""The benchmark harness: every system computes the same thing, and the writers' output.

A benchmark must never time a wrong computation, so at a tiny size every system of
every suite is checked against an independent per-sample reference, in values
(forward) and in gradients (forward+backward).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import _memory, harness
from benchmarks.harness import DISTRIBUTIONS, Case, Missing, occupancy
from benchmarks.segment_ops import OPS, REDUCTIONS, SUITE

ROOT = Path(__file__).resolve().parent.parent
TINY = (3, 1, 5, 2)


def tiny_case(workload: str, mode: str, dtype=torch.float64) -> Case:
    params = {"batch": len(TINY), "dim": 8, "scale": 1.0}
    return Case("segment_ops", workload, mode, "tiny", TINY, params, "cpu", dtype, seed=3)


def reference(case: Case) -> list[torch.Tensor]:
    """Per-sample results computed here from the same seeded inputs."""
    from benchmarks.segment_ops import Inputs

    inputs = Inputs(case)
    starts = [sum(TINY[:i]) for i in range(len(TINY))]
    out = []
    for i, (start, n) in enumerate(zip(starts, TINY, strict=True)):
        t = inputs.values[start : start + n].detach().clone().requires_grad_(True)
        if case.workload == "sum":
            y = t.sum(0)
        elif case.workload == "mean":
            y = t.mean(0)
        elif case.workload == "max":
            y = t.max(0).values
        elif case.workload == "softmax":
            y = torch.exp(t - t.max(0).values) / torch.exp(t - t.max(0).values).sum(0)
        else:
            mu = t.mean(-1, keepdim=True)
            var = ((t - mu) ** 2).mean(-1, keepdim=True)
            y = (t - mu) / torch.sqrt(var + 1e-5) * inputs.weight + inputs.bias
        if case.mode == "fwd":
            out.append(y.detach())
        else:
            cot = (
                inputs.cotangent[i]
                if case.workload in REDUCTIONS
                else inputs.cotangent[start : start + n]
            )
            (g,) = torch.autograd.grad((y * cot).sum(), t)
            out.append(g)
    return out


# torch 2.13's jagged softmax over the ragged axis returns wrong gradients (values are
# right); the harness reports that cell as "wrong" instead of timing it
KNOWN_WRONG = {("nested", "softmax", "fwd+bwd")}


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("workload", OPS)
def test_every_system_agrees_with_the_reference(workload, mode):
    case = tiny_case(workload, mode)
    expected = reference(case)
    ran = []
    for system in SUITE.systems:
        try:
            step = SUITE.build(case, system)
        except Missing:
            continue  # reported as "missing" by the harness
        except Exception as error:
            # only torch.nested may refuse a workload (known gaps, reported as "fails")
            assert system == "nested", f"{system} fails: {error}"
            continue
        got = step.collect(step.run())
        assert len(got) == len(expected), system
        if (system, workload, mode) in KNOWN_WRONG:
            assert any(not torch.allclose(g, e) for g, e in zip(got, expected, strict=True)), (
                f"{system} {workload} {mode} is right now: remove it from KNOWN_WRONG"
            )
            continue
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            torch.testing.assert_close(g, e, msg=lambda m, s=system, i=i: f"{s} sample {i}: {m}")
        step.run()  # a second run gives the same (nothing accumulates between runs)
        ran.append(system)
    assert {"padded", "raggedfn", "loop"} <= set(ran), ran


def test_float32_cells_agree_at_benchmark_dtype():
    for workload in OPS:
        case = tiny_case(workload, "fwd+bwd", torch.float32)
        a = SUITE.build(case, "raggedfn")
        b = SUITE.build(case, "padded")
        for x, y in zip(a.collect(a.run()), b.collect(b.run()), strict=True):
            torch.testing.assert_close(x, y)


def test_padded_softmax_uses_the_mask():
    # a padded softmax without the mask would spread mass onto padding
    case = tiny_case("softmax", "fwd")
    step = SUITE.build(case, "padded")
    for t in step.collect(step.run()):
        torch.testing.assert_close(t.sum(0), torch.ones(8, dtype=torch.float64))
    assert F.softmax(torch.zeros(2), 0).sum() == 1  # the reference identity used above


# ----- distributions ----------------------------------------------------------------------


def test_distributions_hit_their_occupancy_with_fixed_seeds():
    targets = {"lognormal": 0.25, "medium": 0.5, "low": 0.8, "equal": 1.0}
    for name, target in targets.items():
        lengths = DISTRIBUTIONS[name].lengths(32)
        assert lengths == DISTRIBUTIONS[name].lengths(32)  # deterministic
        assert all(16 <= n <= 512 for n in lengths)
        assert abs(occupancy(lengths) - target) < 0.03, (name, occupancy(lengths))
        assert abs(sum(lengths) / 32 - 128) < 4 if name != "lognormal" else True
    lognormal = DISTRIBUTIONS["lognormal"].lengths(32)
    assert abs(sum(lognormal) / 32 - 128) < 4 and max(lognormal) == 512
    assert occupancy([2, 4], power=2) == pytest.approx((4 + 16) / (2 * 16))


# ----- timing and memory ------------------------------------------------------------------


def test_measure_case_fills_every_cell():
    case = tiny_case("sum", "fwd+bwd", torch.float32)
    cells = harness.measure_case(
        SUITE, case, ["padded", "raggedfn", "nested"], warmup=1, repeats=3, min_time=0.0
    )
    by = {c.system: c for c in cells}
    assert by["padded"].status == "ok" and by["padded"].ratio == 1.0
    ok = by["raggedfn"]
    assert ok.status == "ok" and ok.rounds == 3 and ok.time_ms > 0 and ok.baseline_ms > 0
    assert ok.ideal_ratio == pytest.approx(sum(TINY) / (len(TINY) * max(TINY)))
    assert ok.fraction_of_ideal == pytest.approx(ok.ideal_ratio / ok.ratio)
    assert by["nested"].status.startswith("fails: NotImplementedError")
    assert by["nested"].time_ms is None


def test_wrong_systems_are_reported_not_timed():
    case = tiny_case("softmax", "fwd+bwd", torch.float32)
    cells = harness.measure_case(SUITE, case, ["padded", "nested"], repeats=1, min_time=0.0)
    assert cells[1].status.startswith("wrong: sample 0 differs from padded by up to")
    assert cells[1].time_ms is None


def test_missing_names_are_reported_not_raised(monkeypatch):
    import raggedfn

    monkeypatch.delattr(raggedfn, "amax")
    case = tiny_case("max", "fwd", torch.float32)
    cells = harness.measure_case(SUITE, case, ["padded", "raggedfn"], repeats=1, min_time=0.0)
    assert [c.status for c in cells] == ["ok", "missing: raggedfn.amax"]


def test_memory_is_measured_in_a_subprocess():
    case = tiny_case("softmax", "fwd", torch.float32)
    case = Case(**{**case.__dict__, "lengths": (64, 8), "params": {**case.params, "dim": 256}})
    got = harness.measure_memory_systems(case, ["padded", "raggedfn", "no-such-system"], 1)
    # [2, 64, 256] float32 padded input: masked_fill and softmax each make a 128 KiB copy
    assert got["padded"] is not None and 0 <= got["padded"] < 64
    assert got["raggedfn"] is not None and 0 <= got["raggedfn"] < 64
    assert got["no-such-system"] is None  # a failing system is reported, not fatal


# ----- writers ----------------------------------------------------------------------------


def fake_record() -> dict:
    cell = {
        "suite": "demo", "workload": "sum", "mode": "fwd", "distribution": "equal",
        "system": "padded", "status": "ok", "time_ms": 2.0, "baseline_ms": 2.0, "ratio": 1.0,
        "ideal_ratio": 0.5, "fraction_of_ideal": 0.5, "peak_memory_mb": 4.0, "rounds": 3,
        "extra": {},
    }  # fmt: skip
    cells = [
        cell,
        {**cell, "system": "raggedfn", "time_ms": 1.25, "ratio": 0.625, "fraction_of_ideal": 0.8,
         "peak_memory_mb": 1.5},
        {**cell, "system": "nested", "status": "fails: RuntimeError: no", "time_ms": None,
         "ratio": None, "fraction_of_ideal": None, "peak_memory_mb": None},
    ]  # fmt: skip
    return {
        "suite": "demo", "created": "2026-01-01 00:00 UTC", "command": "python -m benchmarks.run",
        "quick": False, "device": "cpu", "threads": 2, "warmup": 3, "repeats": 15,
        "torch": "2.13.0", "machine": {"cpu": "CPU X", "nproc": 2}, "params": {},
        "distributions": {"equal": {"note": "all equal", "lengths": [4, 4], "occupancy": 1.0,
                                    "seed": 0}},
        "systems": ["padded", "raggedfn", "nested"], "primary": "raggedfn", "seconds": 1.0,
        "cells": cells,
    }  # fmt: skip


def test_markdown_table_format():
    assert harness.markdown_table(fake_record()) == (
        "**equal** (all equal; B = 2, mean length 4.0, max 4, occupancy 1.000, seed 0)\n"
        "\n"
        "| op | mode | padded ms | raggedfn ms | nested ms | ideal | raggedfn of ideal "
        "| padded MiB | raggedfn MiB | nested MiB |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        "| sum | fwd | 2.00 | 1.25 (0.62x) | fails | 0.500 | 0.80 | 4.0 | 1.5 |  |\n"
        "\n"
        "Cells that did not run:\n"
        "\n"
        "- nested sum fwd: fails: RuntimeError: no\n"
    )


def test_json_and_markdown_files(tmp_path):
    record = fake_record()
    harness.write_json(record, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == record
    harness.write_markdown(record, tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert text.startswith("### demo (full, cpu)\n")
    assert "on CPU X (2 CPUs), torch 2.13.0, 2 threads" in text
    assert text.endswith(harness.markdown_table(record))


def test_docs_show_the_committed_results():
    """docs/benchmarks.md holds exactly the tables the writer makes from the committed JSON."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert results, "no committed benchmark results"
    shown = 0
    for path in results:
        record = json.loads(path.read_text())
        # every heading and table row the writer makes (summary prose may evolve)
        lines = [
            line
            for line in harness.markdown_table(record).splitlines()
            if line.startswith(("|", "**"))
        ]
        if lines and all(line in docs for line in lines):
            shown += 1
            assert record["torch"] in docs and str(record["machine"]["cpu"]) in docs
    assert shown >= 1, "docs/benchmarks.md shows none of benchmarks/results/*.json"
    for ratio in re.findall(r"\((\d+\.\d+)x\)", docs):
        assert math.isfinite(float(ratio))


# ----- run time budget (issue #6: `make bench` < 20 min, `make bench-quick` < 3 min) -----


def test_slow_steps_count_their_checked_call_as_warm_up():
    calls = []
    run = lambda: calls.append(1)  # noqa: E731
    # a first call slower than SLOW_STEP_S: no warm-up and no calibration calls
    assert harness.warm_up(run, "cpu", 3, 0.03, first=harness.SLOW_STEP_S) == 1
    assert calls == []
    # a fast step: the warm-up calls, then the three calibration calls
    number = harness.warm_up(run, "cpu", 2, 0.03, first=0.0)
    assert len(calls) == 2 + 3 and number > 1


def test_cells_record_their_wall_time():
    case = tiny_case("sum", "fwd", torch.float32)
    cells = harness.measure_case(SUITE, case, ["padded", "raggedfn"], repeats=3, min_time=0.0)
    assert all(c.seconds is not None and c.seconds >= 0 for c in cells)


def test_run_prints_and_records_the_total_time(tmp_path, monkeypatch, capsys):
    import dataclasses

    from benchmarks import run

    tiny = dataclasses.replace(
        SUITE,
        workloads=["sum"],
        modes=["fwd"],
        params=lambda quick: {"batch": 3, "dim": 8, "scale": 0.02},
        distributions=lambda quick: ["lognormal"],
    )
    monkeypatch.setattr(run, "SUITES", ["a", "b"])
    monkeypatch.setattr(run, "load_suite", lambda name: dataclasses.replace(tiny, name=name))
    monkeypatch.setattr(run, "write_plot", lambda record, path: False)
    assert run.main(["--out", str(tmp_path), "--no-memory", "--repeats", "3"]) == 0
    records = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b")]
    for record in records:
        assert record["threads"] == 1  # the default: 2 threads are noisy on 2 shared cores
        assert record["run"] == records[0]["run"]
    total = records[0]["run"]
    assert set(total["suites"]) == {"a", "b"}
    assert total["total_seconds"] >= sum(total["suites"].values()) - 0.2
    assert re.search(
        r"^total elapsed \d+ min \d+ s \(a \d+ s, b \d+ s\)$", capsys.readouterr().out, re.M
    )


def test_memory_of_a_suite_is_measured_in_one_subprocess(monkeypatch):
    base = tiny_case("softmax", "fwd", torch.float32)
    params = {**base.params, "dim": 256}
    big = Case(**{**base.__dict__, "lengths": (2048, 8), "params": params})
    small = Case(**{**base.__dict__, "lengths": (8, 8), "params": params})
    runs = []
    real_run = _memory.subprocess.run

    def counting_run(*args, **kwargs):
        runs.append(args)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(_memory.subprocess, "run", counting_run)
    got = harness.measure_memory_cases(
        [(big, ["padded", "raggedfn"]), (small, []), (small, ["padded"])], 1
    )
    assert len(runs) == 1
    assert got[1] == {}
    # [2, 2048, 256] float32 = 4 MiB: masked_fill and softmax each make a copy
    assert got[0]["padded"] is not None and got[0]["padded"] > 4
    assert got[2]["padded"] is not None and got[2]["padded"] < 2
    assert got[0]["raggedfn"] is not None and got[0]["raggedfn"] < got[0]["padded"]


def test_every_system_runs_in_every_round_in_rotated_order():
    """Systems are interleaved: each round times each system once, the order rotates and
    every other round runs backwards."""
    log: list[str] = []

    def builder(name: str):
        def build(case: Case) -> harness.Step:
            def run() -> torch.Tensor:
                log.append(name)
                return torch.ones(2)

            return harness.Step(run, lambda out: [out])

        return build

    names = ["padded", "raggedfn", "loop"]
    suite = harness.Suite(
        "demo", ["w"], ["fwd"], {n: builder(n) for n in names},
        params=lambda quick: {"batch": 2}, distributions=lambda quick: ["equal"],
        ideal_ratio=lambda case: 1.0,
    )  # fmt: skip
    case = Case("demo", "w", "fwd", "equal", (2, 2))
    cells = harness.measure_case(suite, case, names, warmup=0, repeats=4, min_time=0.0)
    timed = log[-4 * 3 * 1 :]  # min_time 0: one call per sample; calibration came before
    rounds = [timed[i : i + 3] for i in range(0, 12, 3)]
    # rotated, and reversed every other round: each system also runs right after each other
    assert rounds == [names, (names[1:] + names[:1])[::-1], names[2:] + names[:2], names[::-1]]
    by = {c.system: c for c in cells}
    assert all(c.rounds == 4 for c in cells)
    assert set(by["raggedfn"].versus) == {"loop"} and set(by["loop"].versus) == {"raggedfn"}
    assert by["raggedfn"].versus["loop"] > 0


def test_versus_table_shows_the_primary_speedups():
    record = fake_record()
    record["cells"][1]["versus"] = {"nested": 0.5}
    text = harness.markdown_table(record)
    assert "| op | mode | raggedfn vs nested |" in text
    assert "| sum | fwd | 2.00x |" in text


def test_gpu_script_refuses_without_a_device(capsys):
    from benchmarks import gpu

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run every suite")
    assert gpu.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_standalone_rounds_rotate_and_reverse():
    """The standalone scripts' rounds: every system once per round, rotated, every other
    round backwards (so no system always follows the same one); round 0 warms up."""
    from benchmarks._standalone import rotated_rounds

    log: list[str] = []

    def run(name: str):
        def once() -> float:
            log.append(name)
            return {"raggedfn": 1.0, "loop": 2.0, "padded": 4.0}[name]

        return once

    names = ["raggedfn", "loop", "padded"]
    got = rotated_rounds({n: run(n) for n in names}, rounds=3)
    rounds = [log[i : i + 3] for i in range(0, 12, 3)]
    assert rounds == [names, (names[1:] + names[:1])[::-1], names[2:] + names[:2], names[::-1]]
    assert got["raggedfn_over"] == {"loop": 0.5, "padded": 0.25}
