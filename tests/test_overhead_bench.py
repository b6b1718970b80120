"""benchmarks/overhead.py at a tiny size: every row's two calls compute the same thing."""

from __future__ import annotations

import pytest
import torch

from benchmarks import overhead


@pytest.mark.parametrize(
    "name", ["sum", "softmax", "softmax_kernel", "from_lengths", "map", "softmax_unit", "map_unit"]
)
def test_tiny_rows_agree_and_time(name):
    pair = next(p for p in overhead.tiny_pairs() if p.name == name)
    overhead.check(pair)
    row = overhead.measure(pair, rounds=2, min_time=0.0)
    assert row.rounds == 2 and row.ratio > 0 and row.raggedfn_us > 0


def test_gat_rows_agree_with_pyg():
    if overhead._pyg() is None:
        pytest.skip("torch_geometric is not installed")
    pair = overhead.gat_pair("gat", nodes=40, edges=120)
    assert pair is not None
    overhead.check(pair)


def test_a_wrong_row_is_caught():
    if overhead._pyg() is None:
        pytest.skip("torch_geometric is not installed")
    pair = overhead.gat_pair("gat", nodes=40, edges=120)
    assert pair is not None
    right = pair.ours
    pair.ours = lambda: tuple(t * 1.001 if i == 1 else t for i, t in enumerate(right()))
    with pytest.raises(AssertionError, match="gat"):
        overhead.check(pair)


def test_markdown_table_has_one_line_per_row():
    rows = [overhead.Row("sum", "torch", 10.0, 5.0, 2.0, 3)]
    assert overhead.markdown(rows).splitlines()[-1] == "| sum | torch | 10.0 | 5.0 | 2.00 |"
    assert torch.get_num_threads() >= 1
