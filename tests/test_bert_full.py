"""benchmarks/bert_full.py: runs at a tiny size, checks agreement, prints one row per scale."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bert_full


def test_bert_full_prints_a_row_per_scale(capsys):
    bert_full.main(["--scale", "tiny", "--rounds", "1", "--batch", "2"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 1, out
    assert rows[0].endswith("x |")


def test_agreement_check_catches_a_wrong_system():
    lengths = torch.tensor([3, 1])
    values = torch.randn(4, 2)

    def padded(v):
        out = torch.zeros(2, 3, 2)
        out[0, :3], out[1, :1] = v[:3], v[3:]
        return out

    fns = {"raggedfn": lambda v: v, "padded": padded}
    bert_full.check_agreement(fns, values, lengths)
    fns["raggedfn"] = lambda v: v + 1
    with pytest.raises(AssertionError):
        bert_full.check_agreement(fns, values, lengths)
