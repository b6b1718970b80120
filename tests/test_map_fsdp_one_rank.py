"""FSDP2 modules inside ``raggedfn.map`` in this process: a gloo group of one rank.

``tests/test_distributed_fsdp.py`` checks the real thing on 2 spawned ranks; these
checks run the same code path (``_map/entry/_fsdp.py``: FSDP2's pre-forward for every
sharded module ``f`` reaches, benign hooks inside ``f``, the post-forward after it)
in the test process itself, where coverage and mutation testing see it. With one
rank the sharded model must train exactly as the plain one, gather each block once
per ``map`` call, and survive an error inside ``f``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import raggedfn
from property_tests.reference import samples
from tests.test_distributed_fsdp import BLOCKS, STEPS, Model, _tokens, traced_once


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = Path(tmp_path_factory.mktemp("one_rank")) / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        raggedfn.map_cache_clear()  # the traces hold FSDP2's state, and so the group
        dist.destroy_process_group()


def _sharded(mesh: Any, how: str = "call") -> Model:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model(how)
    for block in [*model.blocks, model.pre, model.post]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, lengths in enumerate(STEPS):
        x = raggedfn.from_list(samples(_tokens(lengths[0] + lengths[1], seed=step)))
        opt.zero_grad()
        model(x, 1.0 / x.values.shape[0]).backward()
        opt.step()
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def _plain(how: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return _train(Model(how))


@pytest.mark.parametrize("how", ["call", "outside", "checkpoint", "functional"])
def test_sharded_blocks_train_as_the_plain_model(group: Any, how: str) -> None:
    got = _train(_sharded(group, how))
    want = _plain(how)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=0, msg=name)


def test_each_block_is_gathered_once_per_map_call_and_resharded(group: Any) -> None:
    # one rank: FSDP2 skips the all-gather collective, so count the gathers it starts
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    model = _sharded(group)
    names = {id(p): n for n, p in model.named_parameters()}
    counts: dict[str, int] = {}
    original = FSDPParamGroup.unshard

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = self._all_gather_result is None
        out = original(self, *args, **kwargs)
        if started and self._all_gather_result is not None:
            name = names[id(self.fsdp_params[0].sharded_param)].rsplit(".", 2)[0]
            counts[name] = counts.get(name, 0) + 1
        return out

    FSDPParamGroup.unshard = counting  # type: ignore[method-assign]
    try:
        for lengths in ([3], [2, 4, 1, 5, 3]):
            counts.clear()
            model(_tokens(lengths, seed=0), 1.0).backward()
            expected = {f"blocks.{i}": 2 for i in range(BLOCKS)} | {"pre": 2, "post": 2}
            expected["head"] = 1  # the root: gathered once, kept until the backward
            assert counts == expected, lengths
    finally:
        FSDPParamGroup.unshard = original  # type: ignore[method-assign]
    for block in model.blocks:
        assert all(hasattr(p, "full_tensor") for p in block.parameters())


def test_an_error_inside_f_frees_the_blocks_and_training_goes_on(group: Any) -> None:
    model = _sharded(group)
    blocks = model.blocks

    def broken(t: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            t = block(t)
        raise ValueError("broken f")

    model(_tokens([2], seed=0), 0.0).backward()  # the root's forward first, as FSDP2 asks
    with warnings.catch_warnings():  # the loop that runs after the trace fails
        warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
        with pytest.raises(ValueError, match="broken f"):
            raggedfn.map(broken, _tokens([2, 3], seed=0))
    assert all(hasattr(p, "full_tensor") for p in blocks.parameters())
    model.zero_grad()
    got = _train(model)
    want = _train(_sharded(group))  # the same model never interrupted
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=0, msg=name)


def test_fsdp_state_changes_do_not_retrace(group: Any) -> None:
    assert traced_once(_sharded(group), seed=0) == []
