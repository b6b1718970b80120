"""benchmarks/one_row.py: batches with one-row samples run fully batched, without
warnings, and the record has every field the docs table reads."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks import one_row


def test_one_row_batches_run_batched_without_warnings(tmp_path):
    out = tmp_path / "one_row.json"
    record = one_row.main(["--rounds", "1", "--hidden", "32", "--json", str(out)])
    assert out.exists()
    assert record["fully_batched"], record
    assert record["warnings"] == [], record["warnings"]
    # the one-row samples run on the plan of the longer ones (a second plan for them
    # made those batches 2.09x slower when the absorption was disabled)
    assert record["plans"] == 1, record
    assert set(record["median_ms"]) == {"normal", "one_row"}
    assert record["one_row_over_normal"] > 0 and record["first_one_row_ms"] > 0
    assert all(1 in lengths for lengths in record["lengths"]["one_row"])
    assert "with one-row samples" in one_row.markdown(record)
