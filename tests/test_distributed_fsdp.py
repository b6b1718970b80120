"""FSDP2 (``fully_shard``) on modules called inside ``raggedfn.map``, on 2 gloo processes.

Every check trains a small per-sample transformer-like model (float64) for two
optimizer steps on 2 ranks, each rank holding different samples, and compares
the parameters with one process training the same model on the union batch.
The blocks are called inside the mapped function; each is its own FSDP2 unit,
the root too. One check counts FSDP2's all-gathers: one per block per ``map``
call in the forward and one in the backward, whatever the number of samples.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import raggedfn
from property_tests.reference import samples
from tests import gloo_ranks

WORLD = 2
D = 4
DTYPE = torch.float64
BLOCKS = 3
# per step: rank 0's and rank 1's lengths (rank 1 holds no sample in the last step: it
# gathers and reduces all the same, or rank 0 would wait for it)
STEPS = [([3, 1, 4], [2, 5]), ([1, 2], [6, 0, 3]), ([2, 3], [])]


def _tokens(lengths: list[int], seed: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    if not lengths:
        return raggedfn.from_lengths(
            torch.zeros(0, D, dtype=DTYPE), torch.zeros(0, dtype=torch.int64)
        )
    return raggedfn.from_list([torch.randn(n, D, generator=gen, dtype=DTYPE) for n in lengths])


class Block(torch.nn.Module):
    """Pre-norm self-attention over one sample's tokens, then a feed-forward layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D, dtype=DTYPE)
        self.qkv = torch.nn.Linear(D, 3 * D, dtype=DTYPE)
        self.ff = torch.nn.Linear(D, D, dtype=DTYPE)

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # [N, D]
        q, k, v = self.qkv(self.norm(t)).chunk(3, dim=-1)
        t = t + ((q @ k.T) / math.sqrt(D)).softmax(-1) @ v
        return t + torch.tanh(self.ff(t))


class Model(torch.nn.Module):
    def __init__(self, how: str = "call") -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = torch.nn.Linear(D, 1, dtype=DTYPE)
        # sharded modules f can reach but does not call: run before map (their backward
        # after map's) and after it with "outside", not at all otherwise (not for DDP)
        if how != "ddp":
            self.pre = torch.nn.Linear(D, D, dtype=DTYPE)
            self.post = torch.nn.Linear(D, 1, dtype=DTYPE)
        self.how = how

    def forward(self, x: raggedfn.Ragged, scale: float) -> torch.Tensor:
        if self.how == "outside":
            x = x.with_values(self.pre(x.values))

            def pooled(t: torch.Tensor) -> torch.Tensor:
                for block in self.blocks:
                    t = block(t)
                return t.sum(0)

            return (self.post(raggedfn.map(pooled, x)) ** 2).sum() * scale

        def per_sample(t: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                if self.how == "checkpoint":
                    t = checkpoint(block, t, use_reentrant=False)
                elif self.how == "functional":
                    params = dict(block.named_parameters())
                    t = torch.func.functional_call(block, params, (t,))
                else:
                    t = block(t)
            return (self.head(t) ** 2).sum()

        return raggedfn.map(per_sample, x).sum() * scale


def _train_single(how: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, lengths in enumerate(STEPS):
        xs = [_tokens(lengths[r], seed=1000 * step + r) for r in range(WORLD)]
        union = raggedfn.from_list(samples(xs[0]) + samples(xs[1]))
        opt.zero_grad()
        model(union, 1.0 / union.values.shape[0]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_parallel(rank: int, model: Model, wrapped: torch.nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, lengths in enumerate(STEPS):
        x = _tokens(lengths[rank], seed=1000 * step + rank)
        tokens = torch.tensor([x.values.shape[0]])
        dist.all_reduce(tokens)
        opt.zero_grad()
        # mean over the union's tokens: FSDP averages gradients over the ranks
        wrapped(x, WORLD / int(tokens)).backward()
        opt.step()


def _compare(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    got = model.state_dict()
    for name, value in expected.items():
        full = got[name].full_tensor() if hasattr(got[name], "full_tensor") else got[name]
        if full.shape != value.shape or not torch.allclose(full, value, atol=1e-12, rtol=0):
            problems.append(f"{name}: max error {(full - value).abs().max():.3g}")
    return problems


def _sharded(how: str, blocks: bool) -> Model:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = Model(how)
    if blocks:
        for block in [*model.blocks, model.pre, model.post]:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check(how: str, blocks: bool, rank: int) -> list[str]:
    model = _sharded(how, blocks)
    problems = []
    if blocks and model.blocks[0].qkv.weight.to_local().shape[0] != 3 * D // WORLD:
        problems.append("the block's parameters are not sharded")
    _train_parallel(rank, model, model)
    return problems + _compare(model, _train_single(how))


def check_root_only(rank: int) -> list[str]:
    return _check("call", blocks=False, rank=rank)


def check_every_block_sharded(rank: int) -> list[str]:
    return _check("call", blocks=True, rank=rank)


def check_sharded_modules_outside_map(rank: int) -> list[str]:
    """f closes over the whole model: map also gathers the sharded modules that run
    before and after it (as if f called them and dropped their outputs), and FSDP2
    still reduces each one's gradients once they are complete."""
    return _check("outside", blocks=True, rank=rank)


def check_blocks_sharded_with_checkpointing(rank: int) -> list[str]:
    return _check("checkpoint", blocks=True, rank=rank)


def check_blocks_sharded_with_functional_call(rank: int) -> list[str]:
    return _check("functional", blocks=True, rank=rank)


def check_one_all_gather_per_block_per_map_call(rank: int) -> list[str]:
    """FSDP2's all-gathers per parameter group in one training step: one per block in
    the forward (the root's too) and one per block in the backward; the same for a
    batch of 1 sample and of 5."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    model = _sharded("call", blocks=True)
    names = {id(p): n for n, p in model.named_parameters()}
    counts: dict[str, int] = {}
    original = _fsdp_param_group.foreach_all_gather

    def counting(fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
        name = names[id(fsdp_params[0].sharded_param)].rsplit(".", 2)[0]
        counts[name] = counts.get(name, 0) + 1
        return original(fsdp_params, *args, **kwargs)

    problems = []
    _fsdp_param_group.foreach_all_gather = counting
    try:
        for lengths in ([3], [2, 4, 1, 5, 3]):
            counts.clear()
            model(_tokens(lengths, seed=rank), 1.0).backward()
            # pre and post: f can reach them, so map gathers them as well
            expected = {f"blocks.{i}": 2 for i in range(BLOCKS)} | {"pre": 2, "post": 2}
            expected["head"] = 1  # the root: gathered once, kept until the backward
            if counts != expected:
                problems.append(f"{len(lengths)} samples: all-gathers {counts}")
    finally:
        _fsdp_param_group.foreach_all_gather = original
    for i, block in enumerate(model.blocks):
        if not all(hasattr(p, "full_tensor") for p in block.parameters()):
            problems.append(f"block {i} is not resharded after the step")
    return problems


def check_traced_once(rank: int) -> list[str]:
    """FSDP2's bookkeeping (gathered or not, its training state) changes at every call:
    it is not part of what a trace of f depends on."""
    return traced_once(_sharded("call", blocks=True), seed=rank)


def traced_once(model: Model, seed: int) -> list[str]:
    """Three map calls through the sharded blocks trace once (the problems found)."""
    blocks = model.blocks

    def f(t: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            t = block(t)
        return t.sum()

    for step in range(3):
        raggedfn.map(f, _tokens([2 + step, 3], seed=seed)).sum().backward()
    info = raggedfn.map_cache_info(f)
    return [] if (info.traces, info.hits) == (1, 2) else [f"{info}"]


def check_error_inside_f_leaves_fsdp_usable(rank: int) -> list[str]:
    """f raises (on every rank): the gathered blocks are freed again, and training
    afterwards equals one process."""
    model = _sharded("call", blocks=True)
    blocks = model.blocks

    def broken(t: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            t = block(t)
        raise ValueError("broken f")

    # FSDP2 initializes from the first module whose forward runs: the root's, first
    model(_tokens([2], seed=rank), 0.0).backward()
    problems = []
    try:
        with warnings.catch_warnings():  # the loop that runs after the trace fails
            warnings.simplefilter("ignore", raggedfn.RaggedPerformanceWarning)
            raggedfn.map(broken, _tokens([2, 3], seed=rank))
    except (ValueError, raggedfn.RaggedError) as error:
        if "broken f" not in str(error):
            problems.append(f"error: {error}")
    else:
        problems.append("no error")
    if not all(hasattr(p, "full_tensor") for p in blocks.parameters()):
        problems.append("blocks left gathered after the error")
    _train_parallel(rank, model, model)
    return problems + _compare(model, _train_single("call"))


def _pooled(blocks: torch.nn.ModuleList, t: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        t = block(t)
    return t.sum(0)


def check_mixed_precision_equals_fsdp_per_sample_loop(rank: int) -> list[str]:
    """``MixedPrecisionPolicy(param_dtype=float32)``: each block casts its inputs as
    FSDP2 does for it, inside f. Reference: the same sharded model with a Python
    loop over the samples (FSDP2's hooks at every block call; both ranks hold 3
    samples so that they make the same number of calls)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32)
    x = _tokens([[3, 5, 2], [4, 1, 6]][rank], seed=rank)
    grads = []
    for batched in (True, False):
        torch.manual_seed(0)
        model = Model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        f = functools.partial(_pooled, model.blocks)  # map finds the blocks in f.args
        y = raggedfn.map(f, x) if batched else torch.stack([f(t) for t in samples(x)])
        (y**2).sum().backward()
        if y.dtype != torch.float32:
            return [f"{'map' if batched else 'loop'} computed in {y.dtype}"]
        grads.append({n: p.grad.full_tensor() for n, p in model.blocks.named_parameters()})
    problems = []
    for name, want in grads[1].items():
        got = grads[0][name]
        if got.dtype != DTYPE or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            problems.append(f"{name}: {got.dtype}, max error {(got - want).abs().max():.3g}")
    return problems


def check_ddp_still_works(rank: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = Model("ddp")
    ddp = DistributedDataParallel(model)
    _train_parallel(rank, model, ddp)
    problems = _compare(model, _train_single("ddp"))
    del ddp  # see docs/distributed.md: free DDP before the process group
    return problems


CHECKS = gloo_ranks.checks_of(globals())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    return gloo_ranks.run_checks(CHECKS, WORLD, tmp_path_factory.mktemp("gloo"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_two_ranks(name: str, results: list[dict[str, list[str]]]) -> None:
    assert [r[name] for r in results] == [[]] * WORLD
