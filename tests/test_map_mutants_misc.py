"""``raggedfn.map`` behaviour that ``make mutate`` found untested (docs/testing.md):
dynamo's view of user state while a ``map`` call compiles (``_dynamo_reads``), the
softmax blocks of a one-sample batch, a size made by a shared op behind a number, and
row tiles inside the groups of a chunked run.

Each test compares ``map`` (eager or compiled) with the per-sample loop or eager
``map``, and checks how the call ran; each was seen failing with the surviving mutant
named in its comment applied.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import raggedfn
from property_tests.reference import assert_same, loop
from raggedfn import _prims
from raggedfn._map.rules import _reduce
from raggedfn._map.running import _blocks, _chunked, _tiles
from tests.test_map_compile_guards import _kinds

LAYOUT = raggedfn.Layout.standard(1, 1)
D = 8

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def tokens(lengths, dim=D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return raggedfn.from_list([torch.randn(n, dim, generator=gen, dtype=dtype) for n in lengths])


def _batch(lengths=(3, 5, 2), seed=0):
    x = tokens(lengths, seed=seed)
    return x.values, x.offsets, x.sizes


def _compile(step):
    """``step`` compiled in one graph, and its counter of compiled frames."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    return torch.compile(step, fullgraph=True, dynamic=True, backend=counter), counter


# ----- dynamo's view of user state (tracing/_dynamo_reads.py) ---------------------------


class _Counted(torch.nn.Module):
    """A linear layer, an int and a float read by its forward."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.linear = torch.nn.Linear(D, D)
        with torch.no_grad():
            for p in self.linear.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.repeats = 2
        self.scale = 0.5

    def forward(self, t):
        return (self.linear(t) * self.scale).tanh() * self.repeats


def test_compiled_a_number_the_check_reads_gets_its_value_guard_alone():
    # kills _dynamo_reads._fill_exact_type mutmut_15 (``type(var)`` -> ``type(None)``:
    # the constant's exact type no longer read from its value guard, the compiled check
    # asks ``type(v) is int`` plainly and dynamo adds a TYPE_MATCH guard to the value's)
    model = _Counted()

    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
        return raggedfn.map(model, x).values

    b = _batch()
    want = step(*b)  # eager: traces f, the compiled call checks that trace
    compiled, counter = _compile(step)
    torch.testing.assert_close(compiled(*b), want)
    assert counter.frame_count == 1
    kinds = _kinds(step)
    for name in ("repeats", "scale", "in_features"):
        found = [k for s, k in kinds if s.endswith(f"['{name}']")]
        assert found == ["EQUALS_MATCH"], (name, found)


def test_compiled_a_module_dict_the_step_read_before_map_is_checked_by_its_keys():
    # kills _dynamo_reads.keys_of mutmut_3 (``out = None``): where dynamo has already
    # read the module's parameter dict (the step sums over its values before map), the
    # hook leaves ``out`` alone and keys_of must fall back to ``tuple(table)``; the
    # mutant answered None, the check failed and the compile raised "the state f reads
    # did not match its trace"
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.Linear(D, D)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))

    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
        decay = sum((p * p).sum() for p in model._parameters.values())
        return raggedfn.map(model, x).values, decay

    b = _batch(seed=1)
    want = step(*b)
    assert raggedfn.map_cache_info(model).traces == 1
    compiled, counter = _compile(step)
    got = compiled(*b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got[0], model(b[0]))  # a row-wise f: the loop is f itself
    assert counter.frame_count == 1
    assert raggedfn.map_cache_info(model).traces == 1  # the eager trace, checked and reused
    # the keys still decide: a new parameter is another state, another trace
    model.register_parameter("gain", torch.nn.Parameter(torch.ones(D)))
    torch.testing.assert_close(compiled(*b), step(*b))
    del model.gain


class _Config(dict):
    """A user's config: a dict subclass, which dynamo hands over as the object itself."""


def test_a_lambda_capturing_a_config_that_holds_itself_compiles():
    # kills _dynamo_reads._summary mutmut_15 (``depth + 1`` -> ``depth - 1`` for a dict's
    # values): the memo key of the rebuilt lambda walks its captured values to depth 8;
    # with the depth counted down, a dict that holds itself (a config with a back
    # reference) recursed without end (RecursionError while dynamo compiled)
    cfg = _Config(scale=3.0, shift=-1.0)
    cfg["root"] = cfg

    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
        c = cfg
        return raggedfn.map(lambda t: t * c["scale"] + c["root"]["shift"], x).values

    b = _batch((4, 0, 3), seed=2)
    compiled, counter = _compile(step)
    got = compiled(*b)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, step(*b))
    torch.testing.assert_close(got, b[0] * 3.0 - 1.0)


# ----- the softmax blocks of a one-sample batch (rules/_reduce.py) ----------------------


def test_one_sample_heavy_enough_takes_the_softmax_blocks(monkeypatch):
    # kills _reduce._last_axis_blocks mutmut_20 (``max(B, 1)`` -> ``max(B, 2)``): the
    # threshold is BLOCK_SOFTMAX_MIN elements per sample; a batch of one sample with
    # exactly that many took the segment form under the mutant
    calls = []
    real = _prims.block_softmax
    monkeypatch.setattr(_prims, "block_softmax", lambda *a: calls.append(1) or real(*a))
    n = 1
    while n * n < _reduce.BLOCK_SOFTMAX_MIN:
        n += 1
    assert n * n < 2 * _reduce.BLOCK_SOFTMAX_MIN  # at least the minimum, under twice it

    def f(t):
        return torch.softmax(t @ t.T, -1)  # [n, n]: the softmax over the last ragged axis

    x = tokens((n,), dim=3, dtype=torch.float64, seed=5)
    report = raggedfn.map_report(f, x)
    assert report.fully_batched, report
    assert calls, "the one-sample batch ran the segment softmax"
    assert_same(report.output, loop(f, x))


# ----- a data-dependent size made by a shared op (running/_shared_sizes.py) -------------

SHARED = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)


def _shared_cond(t):
    # a branch on the data of a captured tensor (torch.cond): both branches return a
    # number first, then a tensor whose length differs (a data-dependent size)
    k, picked = torch.cond(
        SHARED.sum() > 0, lambda w: (2, w[:2] * 2), lambda w: (2, w[:3] * 2), (SHARED,)
    )
    return t * picked.sum() * k


def test_a_shared_cond_returning_a_number_then_a_new_size_defines_it_compiled_branches():
    # (torch.cond compiles its branches with dynamo, which mutmut's trampolines stop: the
    # name keeps it out of the mutation slice with the compiled tests)
    # kills _shared_sizes.bind_shared_sizes mutmut_17 (``continue`` -> ``break``): the
    # cond ran once on shared values and returns (int, tensor of a data-dependent
    # length); stopping at the int left the length undefined ("made a data-dependent
    # size its rule did not define")
    x = tokens((3, 0, 2), dim=4, dtype=torch.float64, seed=6)
    report = raggedfn.map_report(_shared_cond, x)
    assert "torch.ops.higher_order.cond" in str(report), report
    assert_same(report.output, loop(_shared_cond, x))


# ----- row tiles in the groups of a chunked run (running/_chunked.py) -------------------

C = 4


def _pair_block(s, w1, b1, w2, b2):
    p = s[:, None] + s[None]
    p = p + torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(p, w1, b1)), w2, b2)
    return torch.softmax(p.sum(-1), -1) @ s


def test_groups_of_a_chunked_run_use_row_tiles(monkeypatch):
    # kills _chunked.run_chunked mutmut_92 (``group_ctx.tiles = True`` -> ``None``): the
    # groups of a run split by chunk_elements ran their row-local chains untiled
    monkeypatch.setattr(_tiles, "TILE_ELEMENTS", 16)
    monkeypatch.setattr(_blocks, "ENABLED", False)
    monkeypatch.setattr(_tiles, "SHARED_FRACTION", 0)  # tiles smaller than the weights
    groups = []
    real = _chunked.run

    def run(plan, ctx, *rest):
        groups.append(ctx.batch_size)
        return real(plan, ctx, *rest)

    monkeypatch.setattr(_chunked, "run", run)
    gen = torch.Generator().manual_seed(7)
    ps = [
        torch.randn(4 * C, C, generator=gen, dtype=torch.float64) / 2,
        torch.randn(4 * C, generator=gen, dtype=torch.float64),
        torch.randn(C, 4 * C, generator=gen, dtype=torch.float64) / 4,
        torch.randn(C, generator=gen, dtype=torch.float64),
    ]
    x = tokens((3, 0, 5, 1, 7, 2, 6, 4), dim=C, dtype=torch.float64, seed=8)
    dims = (0, None, None, None, None)
    report = raggedfn.map_report(_pair_block, x, *ps, in_dims=dims, chunk_elements=300)
    assert len(groups) > 1, groups  # split into groups
    assert report.batched.get("row tiles", 0) >= 1, report.batched
    assert_same(report.output, loop(_pair_block, x, *ps))
