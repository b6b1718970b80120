"""benchmarks/forward_mode.py runs at a tiny size, checks agreement first (both systems,
both Hessian-vector products) and prints one row per transform."""

from __future__ import annotations

import pytest
import torch

from benchmarks import forward_mode


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_forward_mode_benchmark_runs_and_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--batch", "5", "--mean", "3", "--dim", "8", "--heads", "2", "--rounds", "1"]
    record = forward_mode.main(args)
    out = capsys.readouterr().out
    for name in forward_mode.TRANSFORMS:
        assert f"| {name} |" in out
    assert record["over_vjp"]["raggedfn"]["vjp"] == 1.0
    assert len(record["lengths"]) == 5


def test_a_wrong_system_is_caught_before_timing() -> None:
    inputs = forward_mode.Inputs(4, 3, 8, 2)
    table = forward_mode.cells(inputs)
    table["raggedfn", "jvp"] = lambda: 2 * table["loop", "jvp"]()
    with pytest.raises(AssertionError):
        forward_mode.check(table)
