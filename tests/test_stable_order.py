"""Orders that must be stable, on inputs long enough that an unstable sort differs.

``torch.sort`` without ``stable=True`` already reorders equal keys at a few dozen
elements on CPU, so these use hundreds of rows with many ties: ``group_by`` keeps
rows in input order inside each group (against a Python loop), and ``sort`` along a
ragged axis equals ``torch.sort(..., stable=True)`` on every sample, values and
indices (ties included).
"""

from __future__ import annotations

import pytest
import torch

import raggedfn


def test_group_by_keeps_input_order_inside_each_group() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (300,), generator=gen)
    values = torch.arange(300.0).unsqueeze(1)
    grouped, order = raggedfn.group_by(values, ids, 5)
    want = [i for g in range(5) for i in range(300) if ids[i] == g]
    assert order.tolist() == want
    assert grouped.lengths.tolist() == [int((ids == g).sum()) for g in range(5)]
    assert torch.equal(grouped.values, values[want])


@pytest.mark.parametrize("descending", [False, True])
def test_sort_along_a_ragged_axis_is_torchs_stable_sort_per_sample(descending: bool) -> None:
    lengths = [150, 0, 260, 1]
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(0, 5, (sum(lengths), 2), generator=gen).to(torch.float32)
    x = raggedfn.from_lengths(values, torch.tensor(lengths))
    out, indices = raggedfn.sort(x, 1, descending=descending)
    for got, got_index, sample in zip(
        torch.split(out.values, lengths),
        torch.split(indices.values, lengths),
        torch.split(values, lengths),
        strict=True,
    ):
        want, want_index = torch.sort(sample, dim=0, descending=descending, stable=True)
        assert torch.equal(got, want)
        assert torch.equal(got_index, want_index)
