"""raggedfn.distributed and data-parallel training, on 2 real gloo processes.

One ``torch.multiprocessing.spawn`` (file rendezvous) runs every check below on
both ranks, in order; each check returns its mismatches (never raises on a
mismatch, so both ranks always run the same collectives) and each becomes one
test here. Every rank builds every rank's data from fixed seeds, so the
references are computed locally by per-sample loops (``samples``) and a
single-process training run on the union batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import raggedfn
from property_tests.reference import samples
from raggedfn import RaggedError
from raggedfn.data import TokenBudgetBatchSampler
from raggedfn.distributed import all_gather, all_to_all
from tests import gloo_ranks

WORLD = 2
D = 3
DTYPE = torch.float64

# lengths each rank holds, per case: rank 1 of "empty" holds no sample; rank 0 of "mid"
# sends more sizes than a header built from Python lists takes (256), rank 0 of "many"
# more than the header holds inline (2048 per destination for 2 ranks)
CASES: dict[str, tuple[list[int], list[int]]] = {
    "tokens": ([3, 0, 2], [4, 1]),
    "empty": ([2, 5], []),
    "mid": ([i % 5 for i in range(300)], [2, 2]),
    "many": ([i % 4 for i in range(2100)], [1, 2, 0]),
}


def _tokens(lengths: list[int], seed: int, dtype: torch.dtype = DTYPE) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    if not lengths:
        return raggedfn.from_lengths(
            torch.zeros(0, D, dtype=dtype), torch.zeros(0, dtype=torch.int64)
        )
    return raggedfn.from_list([torch.randn(n, D, generator=gen, dtype=dtype) for n in lengths])


def _pairs(lengths: list[int], seed: int) -> raggedfn.Ragged:
    """``[N, D, N]`` samples: two ragged axes, a dense axis between them."""
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list(
        [torch.randn(n, D, n, generator=gen, dtype=DTYPE) for n in lengths], ragged_dims=(1, 3)
    )


def _same(got: raggedfn.Ragged, expected: list[torch.Tensor], like: raggedfn.Ragged) -> list[str]:
    problems = []
    if got.layout != like.layout or got.dtype != like.dtype:
        problems.append(
            f"layout/dtype {got.layout} {got.dtype}, expected {like.layout} {like.dtype}"
        )
    raggedfn.check(got)
    out = samples(got)
    if len(out) != len(expected):
        return [*problems, f"{len(out)} samples, expected {len(expected)}"]
    for i, (a, b) in enumerate(zip(out, expected, strict=True)):
        if a.shape != b.shape or not torch.equal(a, b):
            problems.append(f"sample {i}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
    return problems


def _close(name: str, got: Any, expected: Any, atol: float = 1e-12) -> list[str]:
    if got is None or got.shape != expected.shape:
        return [
            f"{name}: got {None if got is None else tuple(got.shape)}, expected {tuple(expected.shape)}"
        ]
    if not torch.allclose(got, expected, atol=atol, rtol=0):
        return [f"{name}: max difference {(got - expected).abs().max().item():.3g}"]
    return []


# ----- collectives ---------------------------------------------------------------------


def check_all_gather_values(rank: int) -> list[str]:
    problems = []
    for case, lengths in CASES.items():
        xs = [_tokens(lengths[r], seed=r) for r in range(WORLD)]
        got = all_gather(xs[rank])
        problems += [f"{case}: {p}" for p in _same(got, samples(xs[0]) + samples(xs[1]), xs[0])]
    ps = [_pairs([2, 3] if r == 0 else [1], seed=10 + r) for r in range(WORLD)]
    problems += [
        f"pairs: {p}" for p in _same(all_gather(ps[rank]), samples(ps[0]) + samples(ps[1]), ps[0])
    ]
    ints = [_tokens([2, 1] if r == 0 else [3], seed=r).to(torch.int64) for r in range(WORLD)]
    got = all_gather(ints[rank])
    problems += [f"int64: {p}" for p in _same(got, samples(ints[0]) + samples(ints[1]), ints[0])]
    return problems


def _weights(rank: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(100 + rank), dtype=DTYPE)


def check_all_gather_gradients(rank: int) -> list[str]:
    problems = []
    for case, lengths in CASES.items():
        xs = [_tokens(lengths[r], seed=r) for r in range(WORLD)]
        rows = [x.values.shape[0] for x in xs]
        values = xs[rank].values.clone().requires_grad_()
        out = all_gather(xs[rank].with_values(values))
        # every rank weighs the gathered rows differently; the loss is the sum over ranks
        (out.values * _weights(rank, sum(rows))).sum().backward()
        start = sum(rows[:rank])
        expected = sum(_weights(r, sum(rows))[start : start + rows[rank]] for r in range(WORLD))
        problems += _close(f"{case} grad", values.grad, expected)
    return problems


# rank r sends SPLITS[case][r][d] consecutive samples to rank d
SPLITS = {
    "tokens": ([1, 2], [2, 0]),
    "empty": ([0, 2], [0, 0]),
    "mid": ([140, 160], [1, 1]),
    "many": ([2060, 40], [1, 2]),
}


def _received(xs: list[raggedfn.Ragged], splits: tuple[list[int], ...], rank: int) -> list[Any]:
    out = []
    for source in range(WORLD):
        start = sum(splits[source][:rank])
        out += samples(xs[source])[start : start + splits[source][rank]]
    return out


def check_all_to_all_values(rank: int) -> list[str]:
    problems = []
    for case, lengths in CASES.items():
        xs = [_tokens(lengths[r], seed=r) for r in range(WORLD)]
        got = all_to_all(xs[rank], SPLITS[case][rank])
        problems += [f"{case}: {p}" for p in _same(got, _received(xs, SPLITS[case], rank), xs[0])]
    ps = [_pairs([2, 3] if r == 0 else [1, 2], seed=10 + r) for r in range(WORLD)]
    splits = ([1, 1], [2, 0])
    got = all_to_all(ps[rank], torch.tensor(splits[rank]))
    problems += [f"pairs: {p}" for p in _same(got, _received(ps, splits, rank), ps[0])]
    return problems


def _sent_rows(x: raggedfn.Ragged, splits: list[int]) -> list[int]:
    """Packed rows ``x`` sends to each rank."""
    offsets = x.offsets.tolist()
    bounds = [sum(splits[:d]) for d in range(WORLD + 1)]
    return [offsets[bounds[d + 1]] - offsets[bounds[d]] for d in range(WORLD)]


def _expected_all_to_all_grad(xs: list[raggedfn.Ragged], splits: Any, rank: int) -> torch.Tensor:
    """The rows this rank sent to rank d get rank d's weights at their place there."""
    sent = [_sent_rows(xs[s], splits[s]) for s in range(WORLD)]
    parts = []
    for dest in range(WORLD):
        received = sum(sent[s][dest] for s in range(WORLD))
        start = sum(sent[s][dest] for s in range(rank))
        parts.append(_weights(dest, received)[start : start + sent[rank][dest]])
    return torch.cat(parts)


def _exchanged_values(x: raggedfn.Ragged, splits: list[int], values: torch.Tensor) -> torch.Tensor:
    return all_to_all(x.with_values(values), splits).values


def _weighted_sum(
    fn: Callable[[torch.Tensor], torch.Tensor], weights: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    return (fn(v) * weights).sum()


def check_all_to_all_gradients(rank: int) -> list[str]:
    problems = []
    for case, lengths in CASES.items():
        xs = [_tokens(lengths[r], seed=r) for r in range(WORLD)]
        values = xs[rank].values.clone().requires_grad_()
        out = all_to_all(xs[rank].with_values(values), SPLITS[case][rank])
        weights = _weights(rank, out.values.shape[0]).requires_grad_()
        (grad,) = torch.autograd.grad((out.values * weights).sum(), values, create_graph=True)
        expected = _expected_all_to_all_grad(xs, SPLITS[case], rank)
        problems += _close(f"{case} grad", grad, expected)
        # double backward: d/d(weights) of <grad, u> exchanges u forward again
        u = torch.randn(
            values.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=DTYPE
        )
        (second,) = torch.autograd.grad((grad * u).sum(), weights)
        us = [
            torch.randn(
                xs[r].values.shape, generator=torch.Generator().manual_seed(7 + r), dtype=DTYPE
            )
            for r in range(WORLD)
        ]
        sent = [xs[r].with_values(us[r]) for r in range(WORLD)]
        expected_second = _received(sent, SPLITS[case], rank)
        expected_second = torch.cat([*expected_second, torch.zeros(0, D, dtype=DTYPE)])
        problems += _close(f"{case} double backward", second, expected_second)
        # torch.func.grad and forward mode (jvp) through the same exchange
        exchange = functools.partial(_exchanged_values, xs[rank], SPLITS[case][rank])
        func_grad = torch.func.grad(functools.partial(_weighted_sum, exchange, weights.detach()))(
            xs[rank].values
        )
        problems += _close(f"{case} torch.func.grad", func_grad, expected)
        _, tangent_out = torch.func.jvp(exchange, (xs[rank].values,), (us[rank],))
        problems += _close(f"{case} jvp", tangent_out, expected_second)
    return problems


def _samples_from(splits: tuple[list[int], ...], rank: int) -> list[int]:
    """Samples this rank receives from each rank."""
    return [splits[source][rank] for source in range(WORLD)]


def check_all_to_all_given_output_sizes(rank: int) -> list[str]:
    """``output_splits`` / ``output_sizes`` skip the header: same samples, and back again."""
    problems = []
    for case, lengths in CASES.items():
        xs = [_tokens(lengths[r], seed=r) for r in range(WORLD)]
        expected = _received(xs, SPLITS[case], rank)
        froms = _samples_from(SPLITS[case], rank)
        sizes = torch.tensor([[e.shape[0]] for e in expected], dtype=torch.int64).reshape(-1, 1)
        got = all_to_all(xs[rank], SPLITS[case][rank], output_splits=froms, output_sizes=sizes)
        problems += [f"{case}: {p}" for p in _same(got, expected, xs[0])]
        # lengths ([N]) and tensor splits; sending the received samples back restores x
        back = all_to_all(
            got,
            torch.tensor(froms),
            output_splits=torch.tensor(SPLITS[case][rank]),
            output_sizes=xs[rank].sizes[:, 0].to(torch.int32),
        )
        problems += [f"{case} back: {p}" for p in _same(back, samples(xs[rank]), xs[0])]
    ps = [_pairs([2, 3] if r == 0 else [1, 2], seed=10 + r) for r in range(WORLD)]
    splits = ([1, 1], [2, 0])
    expected = _received(ps, splits, rank)
    sizes = torch.tensor([[e.shape[0], e.shape[2]] for e in expected], dtype=torch.int64)
    got = all_to_all(
        ps[rank], splits[rank], output_splits=_samples_from(splits, rank), output_sizes=sizes
    )
    problems += [f"pairs: {p}" for p in _same(got, expected, ps[0])]
    return problems


def check_all_to_all_given_output_sizes_gradients(rank: int) -> list[str]:
    problems = []
    for case, lengths in CASES.items():
        xs = [_tokens(lengths[r], seed=r) for r in range(WORLD)]
        froms = _samples_from(SPLITS[case], rank)
        sizes = all_to_all(xs[rank], SPLITS[case][rank]).sizes
        values = xs[rank].values.clone().requires_grad_()
        out = all_to_all(
            xs[rank].with_values(values),
            SPLITS[case][rank],
            output_splits=froms,
            output_sizes=sizes,
        )
        (out.values * _weights(rank, out.values.shape[0])).sum().backward()
        problems += _close(
            f"{case} grad", values.grad, _expected_all_to_all_grad(xs, SPLITS[case], rank)
        )
    return problems


def check_all_to_all_forward_mode_dual(rank: int) -> list[str]:
    """A ``forward_ad`` dual tensor (no ``torch.func``, no requires_grad) keeps its tangent."""
    from torch.autograd import forward_ad

    problems = []
    for case, lengths in CASES.items():
        xs = [_tokens(lengths[r], seed=r) for r in range(WORLD)]
        us = [_tokens(lengths[r], seed=50 + r) for r in range(WORLD)]
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(xs[rank].values, us[rank].values)
            out = all_to_all(xs[rank].with_values(dual), SPLITS[case][rank]).values
            tangent = forward_ad.unpack_dual(out).tangent
        expected = torch.cat([*_received(us, SPLITS[case], rank), torch.zeros(0, D, dtype=DTYPE)])
        problems += _close(f"{case} tangent", tangent, expected)
    return problems


def check_errors_raise_on_every_rank(rank: int) -> list[str]:
    problems = []
    x = _tokens([1, 2], seed=rank)
    nested = raggedfn.from_list([[torch.ones(1, D)], [torch.ones(2, D), torch.ones(1, D)]])
    bad = {
        "splits": lambda: all_to_all(x, [3, 0] if rank == 0 else [1, 1]),
        "splits count": lambda: all_to_all(x, [2] if rank == 0 else [1, 1]),
        "dense shape": lambda: all_gather(x if rank == 0 else x.with_values(x.values[:, :2])),
        "dtype": lambda: all_to_all(x if rank == 0 else x.float(), [1, 1]),
        # nested values move (test_distributed_nested.py), but every rank must hold them
        "nested (rank 0)": lambda: all_to_all(nested if rank == 0 else x, [1, 1]),
    }
    # given receive sizes nothing is exchanged first: bad ones raise where they are passed
    sizes = torch.tensor([[1], [2]])
    local = {
        "sizes without splits": lambda: all_to_all(x, [1, 1], output_sizes=sizes),
        "float sizes": lambda: all_to_all(
            x, [1, 1], output_splits=[1, 1], output_sizes=1.0 * sizes
        ),
        "sizes of 2 axes": lambda: all_to_all(
            x, [1, 1], output_splits=[1, 1], output_sizes=sizes.repeat(1, 2)
        ),
        "negative sizes": lambda: all_to_all(x, [1, 1], output_splits=[1, 1], output_sizes=-sizes),
        "output splits sum": lambda: all_to_all(
            x, [1, 1], output_splits=[1, 2], output_sizes=sizes
        ),
        "what a rank sends itself": lambda: all_to_all(
            x, [1, 1], output_splits=[2, 0] if rank == 0 else [0, 2], output_sizes=sizes
        ),
    }
    expected = {
        "sizes without splits": "pass both or neither",
        "float sizes": "integer tensor of shape [N] or [N, 1]",
        "sizes of 2 axes": "integer tensor of shape [N] or [N, 1]",
        "negative sizes": "non-negative",
        "output splits sum": "add up to the number of output_sizes 2",
        "what a rank sends itself": f"samples of 3 rows from this rank (rank {rank}), but it sends",
        "nested (rank 0)": f"rank(s) [{1 - rank}] hold values of another layout",
    }
    for name, call in {**bad, **local}.items():
        try:
            call()
            problems.append(f"{name}: no error")
        except RaggedError as error:
            mentions = (
                "rank(s) [0]" in str(error) if rank == 1 and name.startswith("splits") else True
            )
            if not mentions:
                problems.append(f"{name}: rank 1 message does not name rank 0: {error}")
            if name in expected and expected[name] not in str(error):
                problems.append(f"{name}: message {error}")
    return problems


# ----- data-parallel training with raggedfn.map ------------------------------------------


class Model(torch.nn.Module):
    """Per-token squared outputs of a small MLP, summed per sample, through ``map``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(D, 8, dtype=DTYPE)
        self.head = torch.nn.Linear(8, 1, dtype=DTYPE)

    def forward(self, x: raggedfn.Ragged, scale: float) -> torch.Tensor:
        def per_sample(t: torch.Tensor) -> torch.Tensor:
            return (self.head(torch.tanh(self.hidden(t))) ** 2).sum()

        return raggedfn.map(per_sample, x).sum() * scale


STEPS = [([3, 1, 4], [2, 5]), ([1, 1], [6])]  # per step: rank 0's and rank 1's lengths


def _train_single() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, lengths in enumerate(STEPS):
        xs = [_tokens(lengths[r], seed=1000 * step + r) for r in range(WORLD)]
        union = raggedfn.from_list(samples(xs[0]) + samples(xs[1]))
        opt.zero_grad()
        model(union, 1.0 / union.values.shape[0]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_parallel(rank: int, wrap: Callable[[Model], torch.nn.Module]) -> Model:
    torch.manual_seed(0)
    model = Model()
    wrapped = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, lengths in enumerate(STEPS):
        x = _tokens(lengths[rank], seed=1000 * step + rank)
        tokens = torch.tensor([x.values.shape[0]])
        dist.all_reduce(tokens)
        opt.zero_grad()
        # mean over the union's tokens: DDP/FSDP average gradients over the ranks
        wrapped(x, WORLD / int(tokens)).backward()
        opt.step()
    return model


def _compare_params(got: dict[str, Any], expected: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    for name, value in expected.items():
        full = got[name].full_tensor() if hasattr(got[name], "full_tensor") else got[name]
        problems += _close(name, full.detach(), value)
    return problems


def check_ddp_equals_single_process(rank: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    model = _train_parallel(rank, DistributedDataParallel)
    return _compare_params(model.state_dict(), _train_single())


def check_fsdp2_equals_single_process(rank: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _train_parallel(rank, lambda m: fully_shard(m, mesh=mesh))
    return _compare_params(model.state_dict(), _train_single())


def check_fsdp2_sharded_module_inside_map(rank: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))

    def wrap(model: Model) -> torch.nn.Module:
        fully_shard(model.hidden, mesh=mesh)  # called inside the mapped function
        return fully_shard(model, mesh=mesh)

    # gathered once around the map call (tests/test_distributed_fsdp.py has more)
    model = _train_parallel(rank, wrap)
    return _compare_params(model.state_dict(), _train_single())


def check_sampler_reads_the_process_group(rank: int) -> list[str]:
    lengths = list(range(1, 40))
    sampler = TokenBudgetBatchSampler(lengths, 50, seed=1)
    explicit = TokenBudgetBatchSampler(lengths, 50, seed=1, num_replicas=WORLD, rank=rank)
    problems = []
    if (sampler.num_replicas, sampler.rank) != (WORLD, rank):
        problems.append(f"replicas {sampler.num_replicas}, rank {sampler.rank}")
    if list(sampler) != list(explicit):
        problems.append("batches differ from the explicit num_replicas/rank")
    return problems


CHECKS = gloo_ranks.checks_of(globals())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    # torch's own forward-mode decompositions script functions on first use (not our code)
    quiet = (("`torch.jit.script` is deprecated", DeprecationWarning),)
    return gloo_ranks.run_checks(
        CHECKS, WORLD, tmp_path_factory.mktemp("gloo"), ignore_warnings=quiet
    )


# known failures, each a reproducer for its owner
KNOWN: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN[n])) if n in KNOWN else n
        for n in CHECKS
    ],
)
def test_two_ranks(name: str, results: list[dict[str, list[str]]]) -> None:
    assert [r[name] for r in results] == [[]] * WORLD


def test_collectives_need_a_ragged_value() -> None:
    with pytest.raises(RaggedError, match="all_gather: x must be a Ragged"):
        all_gather(torch.ones(3))  # type: ignore[arg-type]
