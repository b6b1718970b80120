"""``raggedfn.map`` behaviour of ``raggedfn/_map/running/`` that ``make mutate`` found
untested (docs/testing.md).

Each test compares ``map`` with the per-sample loop (``property_tests.reference.loop``)
or asserts the documented refusal, and names the surviving mutant it kills; each was
seen failing with that mutant applied.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import RaggedError, RaggedPerformanceWarning
from raggedfn._map.running import _blocks, _tiles

D = 4
BIG = 1 << 40  # chunk_elements: one group of samples, row tiles and blocks enabled


def tokens(lengths, dim=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, dim, generator=gen, dtype=torch.float64) for n in lengths]
    )


def _empty(dim=D):
    values = torch.empty(0, dim, dtype=torch.float64)
    return raggedfn.from_lengths(values, torch.zeros(0, dtype=torch.int64))


# ----- _split.empty_result --------------------------------------------------------------


def _writes_its_argument_past_four(t):
    # the in-place write into the argument: the trace completes (its output specs are
    # known) but cannot run batched; t[4] guards n >= 5, so the probe on small sizes
    # stops, and the output [D] has a fixed-size axis: the structure is unknown
    t.mul_(1)
    return t[4] * 2


def _writes_its_argument(t):
    t.mul_(1)
    return t * 2


def test_empty_batch_of_an_untraceable_f_of_unknown_structure_is_refused():
    """Kills ``_split.x_empty_result__mutmut_1`` (``structure is None and ...``: ``len``
    of the unknown structure raised a TypeError instead of map's refusal)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)
        x = tokens((6, 7))
        want = [_writes_its_argument_past_four(s.clone()) for s in raggedfn.unbind(x)]
        report = raggedfn.map_report(_writes_its_argument_past_four, x)
        assert report.structure is None and report.whole_loop, str(report)
        assert_same(report.output, want)
        with pytest.raises(
            RaggedError, match="the batch is empty, so the output structure is unknown"
        ):
            raggedfn.map(_writes_its_argument_past_four, _empty())
        # the same f without the guard: its structure is known, the empty batch has it
        out = raggedfn.map(_writes_its_argument, _empty())
    assert isinstance(out, raggedfn.Ragged) and out.batch_size == 0
    assert out.values.shape == (0, D) and out.dtype == torch.float64


# ----- _split._trailing_as_ragged -------------------------------------------------------


def _channels_first_scores(t):
    # eagerly (n, 3, 2, min(3, n)): the last axis is ragged; the plan under the guard
    # n >= 3 has it of fixed size 3 and its fixed axes permuted (layout r0 d2 d1 d0)
    s = t @ t.narrow(0, 0, min(3, t.shape[0])).T
    u = s[:, :, None, None] * torch.arange(1.0, 7.0, dtype=t.dtype).view(2, 3)
    return u.permute(0, 3, 2, 1)


def test_the_dynamo_branch_refuses_a_trailing_fixed_axis_of_a_permuted_layout(monkeypatch):
    """Kills ``_split.x__trailing_as_ragged__mutmut_8`` (``row_offsets and layout !=
    standard``): a plan output whose fixed axes are not in standard order cannot become
    ragged from shapes alone; without the refusal its axes came out as (n, 2, 3, m)
    where the loop gives (n, 3, 2, m)."""
    x = tokens((5, 6))
    eager = raggedfn.map(_channels_first_scores, x)
    assert eager.layout == raggedfn.Layout.from_ragged_positions(4, (0, 3))
    assert_same(eager, loop(_channels_first_scores, x))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # map's dynamo branch
    for lengths in ((5, 6), (3, 4, 7)):
        with pytest.raises(
            RaggedError, match=r"inside torch\.compile, an output of f has ragged axes"
        ):
            raggedfn.map(_channels_first_scores, tokens(lengths))


# ----- _tiles.hoistable -----------------------------------------------------------------


def _ranks_by_sorter(t):
    # s is a row-local chain value that searchsorted reads only as its keyword-only
    # ``sorter``: searchsorted must not run before the chain (s would not exist yet)
    s = torch.argsort(t, -1) * 1
    s = s + 0
    pos = torch.searchsorted(t, t, sorter=s)
    return (torch.tanh(t) * 2 + pos) * 3


def test_a_step_reading_a_chain_value_as_a_keyword_is_not_run_before_the_chain(monkeypatch):
    """Kills ``_tiles.x_hoistable__mutmut_9`` (kwargs not read): searchsorted was hoisted
    before the chain's ops and ran with ``sorter=None``, giving silently wrong ranks."""
    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 8)  # row tiles of two rows
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)
    x = tokens((3, 5, 2, 6), seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)  # searchsorted: per sample
        report = raggedfn.map_report(_ranks_by_sorter, x, chunk_elements=BIG)
    assert report.batched.get("row tiles", 0) >= 1, report.batched
    assert_same(report.output, loop(_ranks_by_sorter, x))


# ----- _blocks.run_block ----------------------------------------------------------------


def _pairs_reading_s_three_times(s):
    p = torch.tanh(s[:, None] * s[None] - s)  # s: [N, D], broadcast along the first axis
    q = p * s + p  # s read whole again by a second member
    a = torch.softmax(q.sum(-1), -1)
    return a @ s  # and a third time


def test_row_blocks_cut_each_operand_into_samples_once(monkeypatch):
    """Kills ``_blocks.x_run_block__mutmut_43`` (``index in samples and ...``): an
    operand read by several members of a block was cut into its samples again for each
    read (one ``sizes.tolist()`` host sync each). The values are the same either way:
    this checks the cost, and that the blocks equal the loop."""
    monkeypatch.setattr(_blocks, "TILE_ELEMENTS", 16)
    monkeypatch.setattr(_blocks, "MIN_FILL", BIG)  # blocks for samples of any size
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)
    seen: list[object] = []  # the values themselves: alive, so their ids stay distinct
    per_sample = _blocks._per_sample

    def counted(v):
        seen.append(v)
        return per_sample(v)

    monkeypatch.setattr(_blocks, "_per_sample", counted)
    x = tokens((3, 0, 5, 1, 7), seed=2)
    report = raggedfn.map_report(_pairs_reading_s_three_times, x, chunk_elements=BIG)
    assert report.batched.get("row blocks", 0) == 1, report.batched
    assert seen and len(seen) == len({id(v) for v in seen}), [id(v) for v in seen]
    assert_same(report.output, loop(_pairs_reading_s_three_times, x))
