"""``benchmarks/fsdp_ddp.py`` at a tiny size: 2 gloo processes, FSDP2 (every block
sharded, called inside ``map``) against DDP.

The record must show every block sharded, FSDP2 holding less parameter + gradient +
optimizer state per rank than DDP, DDP's state equal to what its parameter count
implies, and both systems' first-step losses equal to a per-sample loop of one
unsharded copy of the model on each rank's batch (computed here, in this process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import fsdp_ddp, plots

ARGV = ["--blocks", "2", "--hidden", "32", "--heads", "2", "--ff", "64", "--batch", "3"]
ARGV += ["--mean", "8", "--rounds", "1", "--memory-orders", "1"]


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp_ddp") / "fsdp_ddp-tiny.json"
    returned = fsdp_ddp.main([*ARGV, "--json", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def _loop_loss(size: fsdp_ddp.Size, rank: int) -> float:
    """The step-1 loss of rank ``rank``: one process, the seed-0 model, sample by sample."""
    torch.manual_seed(0)
    model = fsdp_ddp.Model(size)
    lengths = size.lengths()
    tokens = fsdp_ddp._tokens(lengths[rank], size.vocab, rank)
    total = torch.zeros(())
    with torch.no_grad():
        for i in range(tokens.batch_size):
            x = model.embed(tokens.values[int(tokens.offsets[i]) : int(tokens.offsets[i + 1])])
            for block in model.blocks:
                x = block(x)
            total = total + (model.head(x.mean(0)) ** 2).sum()
    return float(total) * fsdp_ddp.WORLD / sum(len(ls) for ls in lengths)


def test_the_reference_pair_runs_the_blocks_without_map(record: dict) -> None:
    """plain_fsdp and plain_ddp: the same seed-0 weights on the rank's packed tokens as one
    sequence, both wrappings giving one unsharded process's loss."""
    size = fsdp_ddp.Size(**record["size"])
    lengths = size.lengths()
    for rank in record["ranks"]:
        torch.manual_seed(0)
        model = fsdp_ddp.PlainModel(size)
        tokens = fsdp_ddp._tokens(lengths[rank["rank"]], size.vocab, rank["rank"])
        scale = fsdp_ddp.WORLD / sum(len(ls) for ls in lengths)
        with torch.no_grad():
            want = float(model(tokens, scale))
        assert want != pytest.approx(_loop_loss(size, rank["rank"]))  # not map's model
        for name in fsdp_ddp.PLAIN:
            assert rank["plain_loss_step1"][name] == pytest.approx(want, rel=1e-5, abs=1e-7)
        assert rank["median_ms"].keys() == {*fsdp_ddp.SYSTEMS, *fsdp_ddp.PLAIN}
    assert record["plain_time_ratio"] > 0
    assert "Without raggedfn, for reference" in fsdp_ddp.markdown(record)


def _chunk_numel(p: torch.Tensor, rank: int) -> int:
    rows = -(-p.shape[0] // fsdp_ddp.WORLD)
    return max(0, min(rows, p.shape[0] - rank * rows)) * p[0].numel()


def test_every_block_is_sharded(record: dict) -> None:
    for rank in record["ranks"]:
        assert rank["blocks_sharded"] == [True] * record["size"]["blocks"]


def test_both_systems_start_from_the_per_sample_loops_loss(record: dict) -> None:
    size = fsdp_ddp.Size(**record["size"])
    for rank in record["ranks"]:
        want = _loop_loss(size, rank["rank"])
        for name in fsdp_ddp.SYSTEMS:
            got = rank["loss_step1"][name]
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (rank["rank"], name)


def test_fsdp_holds_less_state_than_ddp(record: dict) -> None:
    size = fsdp_ddp.Size(**record["size"])
    torch.manual_seed(0)
    params = list(fsdp_ddp.Model(size).parameters())
    numel = sum(p.numel() for p in params)
    # DDP: parameters, gradients, Adam's two moments in float32, and a float32 step per
    # parameter
    ddp_bytes = 4 * 4 * numel + 4 * len(params)
    for rank in record["ranks"]:
        assert rank["parameters"] == numel
        assert rank["memory"]["ddp"]["state"]["total"] == ddp_bytes
        # FSDP2: this rank's torch.chunk of every parameter along dim 0, times the same four
        shard = sum(_chunk_numel(p, rank["rank"]) for p in params)
        assert rank["memory"]["fsdp"]["state"]["total"] == 4 * 4 * shard + 4 * len(params)
        assert rank["memory"]["fsdp"]["state"]["total"] < ddp_bytes
    assert record["state_ratio"] < 1
    assert record["time_ratio"] > 0 and record["meets_targets"].keys() == {
        "state_ratio",
        "time_ratio",
    }


def test_the_record_has_its_table_and_plotter(record: dict, tmp_path: Path) -> None:
    text = fsdp_ddp.markdown(record)
    assert text.count("\n| fsdp") == 2 and "\n| ddp |" in text
    assert plots.PLOTTERS["fsdp_ddp"] is plots.plot_fsdp_ddp
    pytest.importorskip("matplotlib")
    assert plots.plot_fsdp_ddp(record, tmp_path / "p.png")
