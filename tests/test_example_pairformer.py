"""examples/pairformer.py: the per-sample block through raggedfn.map equals the loop; it runs."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import raggedfn
from examples import pairformer


@functools.cache
def block_and_pairs() -> tuple[pairformer.PairformerBlock, raggedfn.Ragged]:
    torch.manual_seed(0)
    block = pairformer.PairformerBlock(channels=8, heads=2).double()
    gen = torch.Generator().manual_seed(1)
    pairs = pairformer.make_pairs(gen, 3, 2, 6, 8)
    return block, pairs.with_values(pairs.values.double())


def test_block_through_map_equals_the_block_on_each_sample():
    block, pairs = block_and_pairs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the attention's per-sample fallback warns
        out = raggedfn.map(block, pairs)
    assert out.shape == (3, None, None, 8) and torch.equal(out.sizes, pairs.sizes)
    for got, z in zip(raggedfn.unbind(out), raggedfn.unbind(pairs), strict=True):
        torch.testing.assert_close(got, block(z), atol=1e-12, rtol=1e-12)


def test_gradients_through_map_equal_the_loop():
    block, pairs = block_and_pairs()
    assert pairformer.check(block, pairs) < 1e-12


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="aten.scaled_dot_product_attention.default runs per sample (attention with ragged "
    "batch axes: the rows of a pair state); issue #17",
)
def test_block_runs_fully_batched():
    block, pairs = block_and_pairs()
    report = pairformer.report(block, pairs)
    assert report.fully_batched, str(report)


def test_example_runs_at_a_small_size(capsys):
    args = ["--batch", "3", "--min-len", "2", "--max-len", "6", "--channels", "8"]
    assert pairformer.main([*args, "--heads", "2", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "map vs per-sample loop" in out and "forward+backward" in out
