"""benchmarks/moe.py and benchmarks/doc_encoder.py run at tiny sizes, check agreement
first and print one row per mode."""

from __future__ import annotations

import pytest
import torch

from benchmarks import doc_encoder, moe


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_moe_benchmark_runs_and_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    record = moe.main(["--tokens", "64", "--experts", "4", "--dim", "8", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "| fwd |" in out and "| fwd+bwd |" in out
    assert sum(record["tokens_per_expert"]) == 64
    counts = record["tokens_per_expert"]
    assert counts[0] == max(counts)  # skewed towards expert 0


def test_moe_systems_agree_with_a_per_token_reference() -> None:
    x, ids, p = moe.make_inputs(40, 3, 5)
    want = torch.stack([x[t] @ p["weight"][ids[t]] + p["bias"][ids[t]] for t in range(40)])
    for name, fn in moe.SYSTEMS.items():
        torch.testing.assert_close(fn(x, ids, p), want, msg=name)


def test_doc_encoder_benchmark_runs_and_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    record = doc_encoder.main(["--docs", "3", "--dim", "8", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "| fwd |" in out and "| fwd+bwd |" in out
    b, s, length = record["padded_shape"]
    assert record["ideal_ratio"] == record["tokens"] / (b * s * length)


def test_doc_encoder_padded_equals_the_loop() -> None:
    shape = [[3, 2], [4], [2, 5, 3]]
    data = doc_encoder.inputs(shape, 6)
    p = doc_encoder.make_params(6)
    want = doc_encoder.encode_loop(data["documents"], p)
    torch.testing.assert_close(doc_encoder.encode_padded(data["padded"], data["mask"], p), want)
    torch.testing.assert_close(doc_encoder.encode_ragged(data["nested"], p), want)
