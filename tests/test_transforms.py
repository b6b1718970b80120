"""Every torch.func transform, eagerly and compiled, through chains of raggedfn ops.

The table in docs/transforms.md is measured by these tests: each (transform, mode)
cell names the test that checks it. Eager results are compared with the same
transform of a per-sample loop of torch ops; compiled results with eager, with
the number of graphs asserted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.utils import counters
from torch.func import grad, hessian, jacfwd, jacrev, jvp, linearize, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import raggedfn

# dynamo instantiates the _prims Functions it traces; the warning is torch's own
pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

D = 4
LENGTHS = [3, 0, 2, 4]
F64 = torch.float64
X = raggedfn.from_lengths(torch.zeros(sum(LENGTHS), D, dtype=F64), LENGTHS)


def _inputs(seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(sum(LENGTHS), D, generator=gen, dtype=F64)
    w = torch.randn(D, D, generator=gen, dtype=F64) / 2
    return v, w


def _finite(t: Tensor) -> Tensor:
    """Policy values of empty samples (-inf max, -inf logsumexp) as 0."""
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def compiled_chain(v: Tensor, w: Tensor) -> Tensor:
    """[B, D]: ops that compile to plain graphs (no host-planned node, no prod)."""
    h = raggedfn.layer_norm(raggedfn.linear(X.with_values(v), w), D)
    s = raggedfn.softmax(h, 1) * h
    pooled = raggedfn.sum(s, 1) + _finite(raggedfn.amax(h, 1))
    pooled = pooled + _finite(raggedfn.logsumexp(raggedfn.log_softmax(h, 1), 1))
    return (pooled + raggedfn.sum(raggedfn.cumsum(h, 1), 1)).sin()


def chain(v: Tensor, w: Tensor) -> Tensor:
    """[B, D]: :func:`compiled_chain` plus attention, products of ragged operands, prod,
    sort values and rms_norm."""
    h = raggedfn.layer_norm(raggedfn.linear(X.with_values(v), w), D)
    heads = raggedfn.unsqueeze(h, 2)  # (B, N*, 1, D)
    attended = raggedfn.squeeze(raggedfn.attention(heads, heads, heads, causal=True), 2)
    scores = raggedfn.softmax(raggedfn.einsum("bnd,bmd->bnm", h, h), 2)
    mixed = raggedfn.rms_norm(raggedfn.matmul(scores, attended), D)
    top = raggedfn.sort(mixed, 1, descending=True)[0]
    pooled = raggedfn.sum(top * raggedfn.softmax(top, 1), 1) + raggedfn.prod(
        raggedfn.apply(torch.tanh, mixed), 1
    )
    return compiled_chain(v, w) + pooled.cos()


def loop_compiled_chain(v: Tensor, w: Tensor) -> Tensor:
    """:func:`compiled_chain` as a per-sample loop of torch ops."""
    rows = []
    for t in torch.split(v, LENGTHS):
        h = F.layer_norm(F.linear(t, w), (D,))
        s = h.softmax(0) * h
        pooled = s.sum(0)
        if t.shape[0]:  # max and logsumexp of an empty sample are policy values (-> 0 here)
            pooled = pooled + h.amax(0) + h.log_softmax(0).logsumexp(0)
        rows.append((pooled + h.cumsum(0).sum(0)).sin())
    return torch.stack(rows)


def loop_chain(v: Tensor, w: Tensor) -> Tensor:
    """:func:`chain` as a per-sample loop of torch ops."""
    rows = []
    for t in torch.split(v, LENGTHS):
        h = F.layer_norm(F.linear(t, w), (D,))
        attended = F.scaled_dot_product_attention(h[None], h[None], h[None], is_causal=True)[0]
        scores = (h @ h.T).softmax(1)
        mixed = F.rms_norm(scores @ attended, (D,))
        top = mixed.sort(0, descending=True).values
        rows.append(((top * top.softmax(0)).sum(0) + mixed.tanh().prod(0)).cos())
    return loop_compiled_chain(v, w) + torch.stack(rows)


def _loss(f: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    def loss(v: Tensor, w: Tensor) -> Tensor:
        out = f(v, w)
        return (out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum()

    return loss


TANGENTS = _inputs(1)
COTANGENT = torch.linspace(-1, 1, len(LENGTHS) * D, dtype=F64).view(len(LENGTHS), D)

# transform name -> g(f, v, w) with f a function of (v, w): the transform applied at (v, w)
TRANSFORMS: dict[str, Callable[[Callable[..., Tensor], Tensor, Tensor], Any]] = {
    "grad": lambda f, v, w: grad(_loss(f), argnums=(0, 1))(v, w),
    "vjp": lambda f, v, w: vjp(f, v, w)[1](COTANGENT),
    "jacrev": lambda f, v, w: jacrev(f, argnums=(0, 1))(v, w),
    "jvp": lambda f, v, w: jvp(f, (v, w), TANGENTS),
    "jacfwd": lambda f, v, w: jacfwd(f, argnums=(0, 1))(v, w),
    "hessian": lambda f, v, w: hessian(_loss(f), argnums=1)(v, w),
    "linearize": lambda f, v, w: linearize(f, v, w)[1](*TANGENTS),
    "vmap": lambda f, v, w: vmap(f, in_dims=(0, None))(torch.stack([v, v.flip(0), 2 * v]), w),
}


# torch's own note that vmap over the fused CPU SDPA backward (jacrev, vmap of grad) loops
SDPA_BATCHING_NOTE = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching rule"
    ":UserWarning"
)


def _math_sdpa(fn: Callable[[], Any]) -> Any:
    """The loop's SDPA on torch's math backend (its fused CPU kernel has no forward AD)."""
    with sdpa_kernel(SDPBackend.MATH):
        return fn()


@SDPA_BATCHING_NOTE
# torch.func.linearize's own make_fx trace warns about its constants (any function does)
@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node:UserWarning")
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_eager_transform_of_a_chain_equals_the_loop(name: str) -> None:
    v, w = _inputs()
    got = TRANSFORMS[name](chain, v, w)
    want = _math_sdpa(lambda: TRANSFORMS[name](loop_chain, v, w))
    torch.testing.assert_close(got, want)


@SDPA_BATCHING_NOTE
@pytest.mark.parametrize("f", [chain, compiled_chain], ids=["chain", "compiled_chain"])
def test_jacfwd_equals_jacrev_on_chains(f: Callable[..., Tensor]) -> None:
    v, w = _inputs(2)
    for argnums in (0, 1):
        torch.testing.assert_close(
            jacfwd(f, argnums=argnums)(v, w), jacrev(f, argnums=argnums)(v, w)
        )


@pytest.mark.parametrize("name", sorted(set(TRANSFORMS) - {"linearize"}))
def test_compiled_transform_of_a_chain_equals_eager_in_one_graph(name: str) -> None:
    """torch.compile(transform(f), fullgraph=True), aot_eager (inductor: the next test)."""
    v, w = _inputs(3)

    def run(v: Tensor, w: Tensor) -> Any:
        return TRANSFORMS[name](compiled_chain, v, w)

    want = run(v, w)
    torch.testing.assert_close(
        want, _math_sdpa(lambda: TRANSFORMS[name](loop_compiled_chain, v, w))
    )
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(run, fullgraph=True, backend="aot_eager")(v, w)
    torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] == 1


def small_chain(v: Tensor, w: Tensor) -> Tensor:
    """[B, D]: the ops whose gathers and segment sums inductor 2.13 miscompiles under
    transforms when written with index_select/index_add (see _prims.take_rows)."""
    x = X.with_values(v)
    s = raggedfn.softmax(x, 1) * raggedfn.linear(x, w)
    return (raggedfn.sum(s, 1) + _finite(raggedfn.amax(x, 1))).sin()


# inductor's own lowering of gather/scatter_add calls a deprecated torch helper
@pytest.mark.filterwarnings("ignore:`torch._prims_common.check` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", sorted(set(TRANSFORMS) - {"linearize"}))
def test_inductor_compiled_transform_equals_eager(name: str) -> None:
    """Every transform but linearize (refused by torch). With index_select in these
    graphs inductor 2.13 gave wrong jacrev values, failed to generate jvp code, and
    crashed the process on hessian."""
    v, w = _inputs(4)

    def run(v: Tensor, w: Tensor) -> Any:
        return TRANSFORMS[name](small_chain, v, w)

    want = run(v, w)
    torch._dynamo.reset()
    counters.clear()
    torch.testing.assert_close(torch.compile(run, fullgraph=True)(v, w), want)
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_linearize_is_refused_by_torch() -> None:
    """torch.func.linearize traces with make_fx, which dynamo refuses to trace."""
    v, w = _inputs()
    compiled = torch.compile(
        lambda v, w: TRANSFORMS["linearize"](compiled_chain, v, w), fullgraph=True, backend="eager"
    )
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disallow_in_graph"):
        compiled(v, w)


# ----- through raggedfn.map, compiled ---------------------------------------------------


def _mapped(t: Tensor, w: Tensor) -> Tensor:
    """Batched ops only: the map runs fully batched."""
    return (F.layer_norm(t @ w, (D,)).softmax(0) * t).sum(0)


def _flipped(t: Tensor, w: Tensor) -> Tensor:
    """aten.flip has no batching rule: that node runs per sample (a graph break)."""
    return (torch.flip(t, [0]) @ w).cumsum(0).sin().sum(0)


MAP_TRANSFORMS = ["grad", "jvp", "jacfwd", "hessian"]


def _map_transform(name: str, fn: Callable[..., Tensor]) -> Callable[[Tensor, Tensor], Any]:
    def run(v: Tensor, w: Tensor) -> Any:
        return TRANSFORMS[name](
            lambda v, w: raggedfn.map(fn, X.with_values(v), w, in_dims=(0, None)), v, w
        )

    return run


@pytest.mark.parametrize("name", MAP_TRANSFORMS)
def test_compiled_transform_through_a_batched_map_equals_eager_in_one_graph(name: str) -> None:
    v, w = _inputs(5)
    run = _map_transform(name, _mapped)
    assert raggedfn.map_report(_mapped, X.with_values(v), w, in_dims=(0, None)).fully_batched
    want = run(v, w)  # also the eager trace that map needs before compiling
    torch.testing.assert_close(want, TRANSFORMS[name](_loop_of(_mapped), v, w))
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(run, fullgraph=True, backend="aot_eager")(v, w)
    torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] == 1


def _loop_of(fn: Callable[..., Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda v, w: torch.stack([fn(t, w) for t in torch.split(v, LENGTHS)])


def test_compiled_transform_through_a_fallback_map_breaks_the_graph_and_equals_eager() -> None:
    """The per-sample loop cannot run inside one graph (docs/map.md): without
    fullgraph=True dynamo breaks the graph and the answer is the eager one."""
    v, w = _inputs(6)
    run = _map_transform("jvp", _flipped)
    assert not raggedfn.map_report(_flipped, X.with_values(v), w, in_dims=(0, None)).fully_batched
    want = run(v, w)
    torch.testing.assert_close(want, TRANSFORMS["jvp"](_loop_of(_flipped), v, w))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(run, backend="aot_eager")(v, w), want)
