"""Row tiles: a chain of row-local ops run on cache-sized tiles of the packed rows.

``p + W2 gelu(W1 p)`` on a pair state makes ``[T, 4C]`` intermediates whose rows are
independent: each packed row (one pair) only meets the shared weights. Run op by op,
every intermediate is written to memory and read back (tens of MB); run on tiles of
a few thousand rows, the whole chain stays in the L2 cache, forward and backward
(autograd runs each tile's backward in turn). Measured on this chain alone (1 thread,
22500 rows, C = 32): 2.6-3.7x faster forward and 1.6x forward+backward with tiles of
1024-4096 rows than on the whole block, which is what the per-sample loop does.

A chain is a run of consecutive plan steps, each an op in :data:`ROW_OPS` whose
result has the same ragged sizes (leading logical axes) as the others; tensors that
do not depend on the sample (weights) enter as they are. A pointwise op may broadcast
a ragged operand along a ragged axis (``s[:, None] + s[None]``): each tile gathers
its own rows of it (``index_select`` with the tile's slice of the row index), so the
pair state exists only tile by tile. Steps between the chain's ops that read none of
its values (weights, the vector a pair state is built from) run first, as a whole.
Values of the chain that later steps or the outputs read are joined with one
``cat``; the rest live only inside a tile. Anything the tile runner does not expect
sends the chain back to the ordinary step-by-step path.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..base._sizes import Sz, Unsupported
from ..base._steps import Plan, Ref, Step, TSpec, refs
from ..base._values import Ctx, RaggedB, canonical_layout, ragged_alignment, take_rows

aten = torch.ops.aten

# elements of the widest intermediate of one tile (1 MiB of float32: half this CPU's
# L2 cache, so a tile's input, hidden layer and output stay in it)
TILE_ELEMENTS = 1 << 18
# chains shorter than this gain nothing from tiles (one op reads and writes once anyway)
MIN_CHAIN = 3

ROW_OPS = frozenset(
    {
        aten.linear,
        aten.gelu,
        aten.relu,
        aten.silu,
        aten.sigmoid,
        aten.tanh,
        aten.exp,
        aten.neg,
        aten.add,
        aten.sub,
        aten.mul,
        aten.div,
        aten.rsub,
    }
)
# reductions over fixed-size trailing axes: row-local too (their dims are rewritten
# from the sample's logical axes to the tile's: negative, counted from the end)
ROW_REDUCTIONS = frozenset({aten.sum, aten.mean})
# ops whose ragged operands may broadcast along a ragged axis of the result (the pair
# state ``s[:, None] + s[None]``): a tile gathers its own rows of each such operand,
# so the broadcast result never exists for the whole batch
BROADCAST_OPS = frozenset({aten.add, aten.sub, aten.mul, aten.div, aten.rsub})


class Chain:
    __slots__ = ("drops", "exported", "members", "prefix", "start", "stop")

    def __init__(self, start: int, stop: int, prefix: tuple[str, ...], members: list[int]) -> None:
        self.start = start  # steps start..stop-1
        self.stop = stop
        self.prefix = prefix  # keys of the leading ragged sizes
        # the steps run on tiles; the others in start..stop read no value of the chain
        # (a weight, the vector a pair state is built from) and run first, as a whole
        self.members = members
        self.exported: set[int] = set()  # chain steps whose values are read after it
        self.drops: dict[int, tuple[int, ...]] = {}  # see drops_of


def hoistable(step: Step, inside: set[int]) -> bool:
    """Whether a step between a chain's ops may run before them: it reads no value of
    the chain, draws no random numbers and writes nothing in place."""
    if step.rebind or step.defines or step.random:
        return False
    read: set[int] = set()
    refs(step.args, read)
    refs(step.kwargs, read)
    return not (read & inside)


def ragged_prefix(spec: Any) -> tuple[str, ...] | None:
    """Keys of the leading ragged sizes of a result whose ragged axes all lead."""
    if not isinstance(spec, TSpec) or not spec.ragged:
        return None
    count = 0
    while count < len(spec.shape) and isinstance(spec.shape[count], Sz):
        count += 1
    if any(isinstance(s, Sz) for s in spec.shape[count:]):
        return None
    return tuple(s.key for s in spec.shape[:count])


def _row_local_of(step: Step, spec_of: Any = None) -> tuple[str, ...] | None:
    """The ragged prefix of a step a chain can hold, else None: a row-local op whose
    operands with ragged sizes have its result's (no broadcast along a ragged axis)."""
    prefix = _row_op(step)
    if prefix is None or spec_of is None:
        return prefix
    read: set[int] = set()
    refs(step.args, read)
    refs(step.kwargs, read)
    broadcast = step.target.overloadpacket in BROADCAST_OPS
    for index in read:
        spec = spec_of(index)
        if isinstance(spec, TSpec) and spec.ragged and ragged_prefix(spec) != prefix:
            keys = {s.key for s in spec.shape if isinstance(s, Sz)}
            if not broadcast or not keys <= set(prefix):
                return None
    return prefix


def _row_op(step: Step) -> tuple[str, ...] | None:
    if not step.batched or step.slot is not None or step.random or step.defines:
        return None
    if step.rebind or step.getitem:
        return None
    packet = getattr(step.target, "overloadpacket", None)
    prefix = ragged_prefix(step.out)
    if packet in ROW_REDUCTIONS and prefix is not None:
        dims = _reduced_dims(step)
        if dims is None:
            return None
        return prefix
    if packet not in ROW_OPS:
        return None
    return prefix


def _reduced_dims(step: Step) -> list[int] | None:
    """A row-local reduction's dims counted from the end of the sample's shape, or None
    (not over fixed-size trailing axes only, or not of that form)."""
    if len(step.args) < 2 or not isinstance(step.args[0], Ref):
        return None
    dims = step.args[1]
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not dims or not all(isinstance(d, int) for d in dims):
        return None
    keepdim = bool(step.args[2]) if len(step.args) > 2 else bool(step.kwargs.get("keepdim"))
    rank = len(step.out.shape) + (0 if keepdim else len(dims))
    out = [d - rank if d >= 0 else d for d in dims]
    prefix = ragged_prefix(step.out)
    dense = rank - len(prefix or ())
    if any(d < -dense for d in out):
        return None
    return out


# tiles pay off only while the tensors every tile reads again (the weights) are small
# next to a tile: a token MLP's 256 x 1024 weights (0.5M elements) read once per tile of
# 64-256 rows made `map` 1.1-1.7x slower (benchmarks/tiles_ab.py, token_mlp), a pair
# state's 32 x 128 ones (8K) let tiles run 1.3-2x faster than op by op
SHARED_FRACTION = 8


def worth_tiles(shared: int, tile: int | None = None) -> bool:
    """Whether a chain whose tiles each read ``shared`` elements of weights gains."""
    return shared * SHARED_FRACTION <= (TILE_ELEMENTS if tile is None else tile)


def drops_of(plan: Plan, count: int, members: list[int]) -> dict[int, tuple[int, ...]]:
    """For each member step: the values a tile holds that no later member reads (its
    own when none does), dropped once it has run so that a tile's working set is what
    the loop's would be (the next op's output reuses the memory, still in cache)."""
    last: dict[int, int] = {}
    for k in members:
        read: set[int] = set()
        refs(plan.steps[k].args, read)
        refs(plan.steps[k].kwargs, read)
        for index in read:
            last[index] = k
    out: dict[int, list[int]] = {k: [] for k in members}
    for index, k in last.items():
        out[k].append(index)
    for k in members:
        if count + k not in last:
            out[k].append(count + k)
    return {k: tuple(v) for k, v in out.items()}


def chains(plan: Plan, count: int) -> dict[int, Chain]:
    """Chains of ``plan`` (run with ``count`` inputs) by their first step (cached)."""
    cached = getattr(plan, "_row_chains", None)
    if cached is not None and cached[0] == count:
        return cached[1]
    found: dict[int, Chain] = {}
    steps = plan.steps

    def spec_of(index: int) -> Any:
        if index < count:
            return plan.inputs[index] if index < len(plan.inputs) else None
        return steps[index - count].out

    def _row_local(step: Step) -> tuple[str, ...] | None:
        return _row_local_of(step, spec_of)

    k = 0
    while k < len(steps):
        prefix = _row_local(steps[k])
        if prefix is None:
            k += 1
            continue
        members = [k]
        inside = {count + k}
        stop = k + 1
        while stop < len(steps):
            nxt = steps[stop]
            if nxt.slot is not None or not nxt.batched:
                stop += 1  # a weight read or prepared between the ops: no sample in it
                continue
            if _row_local(nxt) == prefix:
                members.append(stop)
                inside.add(count + stop)
            elif not hoistable(nxt, inside):
                break
            stop += 1
        stop = members[-1] + 1  # end on an op of the chain
        if len(members) >= MIN_CHAIN:
            chain = Chain(k, stop, prefix, members)
            chain.exported = read_after(plan, stop, inside)
            chain.drops = drops_of(plan, count, members)
            found[k] = chain
        k = max(stop, k + 1)
    plan._row_chains = (count, found)  # type: ignore[attr-defined]
    return found


def read_after(plan: Plan, stop: int, inside: set[int]) -> set[int]:
    """The values of ``inside`` that a step from ``stop`` on, an in-place rebind or an
    output of ``plan`` reads (a chain's values to join after its tiles)."""
    later: set[int] = set()
    for s in plan.steps[stop:]:
        refs(s.args, later)
        refs(s.kwargs, later)
        later.update(s.rebind or ())
    for o in plan.outputs:
        refs(o, later)
    return {i for i in inside if i in later}


def run_chain(
    ctx: Ctx,
    plan: Plan,
    chain: Chain,
    values: list[Any],
    count: int,
    resolve: Any,
    run_plain: Any,
) -> bool:
    """Run the steps of ``chain`` that are not its members (``run_plain(k)`` runs step
    ``k`` the ordinary way), then its members on row tiles, writing their values into
    ``values``; False (members not run) when their operands are not what tiles need."""
    for k in range(chain.start, chain.stop):
        if k not in chain.members:
            run_plain(k)
    steps = plan.steps[chain.start : chain.stop]
    base = count + chain.start
    sz = tuple(_sizes(steps, chain))
    layout_of: dict[int, Any] = {}  # rank -> the canonical layout of a chain result of that rank
    struct = None
    widths: list[int] = []
    entries: dict[int, Tensor] = {}
    # operands broadcast along a ragged axis: (values, rows of each result row, finish)
    gathers: dict[int, tuple[Tensor, Tensor, Any]] = {}
    ranks: dict[int, int] = {}  # the result rank each such operand is aligned to
    aligned = False  # an operand laid out through the chain's own struct
    shared: dict[int, int] = {}  # elements of the tensors every tile reads (weights)
    for step in (plan.steps[k] for k in chain.members):
        read: set[int] = set()
        refs(step.args, read)
        refs(step.kwargs, read)
        rank = len(step.out.shape)
        for index in read:
            if index - count in chain.members:
                continue
            v = values[index]
            if isinstance(v, RaggedB):
                ragged = len(v.sz)
                if tuple(s.key for s in v.sz) != chain.prefix or v.layout != canonical_layout(
                    len(v.shape()), tuple(range(ragged))
                ):
                    if step.target.overloadpacket not in BROADCAST_OPS:
                        return False
                    if index in ranks:
                        if ranks[index] != rank:
                            return False  # aligned two ways: not worth a second plan
                        continue
                    ranks[index] = rank
                    if rank not in layout_of:
                        layout_of[rank] = canonical_layout(rank, tuple(range(len(sz))))
                    try:
                        index_rows, finish = ragged_alignment(
                            ctx, v, step.out.shape, layout_of[rank], ctx.struct(sz)
                        )
                    except Unsupported:
                        return False
                    aligned = True
                    if index_rows is None:  # its own rows in another dense order
                        entries[index] = finish(v.values)
                    else:
                        gathers[index] = (v.values, index_rows, finish)
                    continue
                if struct is None:
                    struct = v.struct
                elif v.struct is not struct:
                    return False
                entries[index] = v.values
            elif isinstance(v, Tensor):
                dense = rank - len(chain.prefix)
                if step.target.overloadpacket is not aten.linear and v.ndim > dense:
                    return False  # it would broadcast along a ragged axis
                shared[index] = v.numel()
            elif not isinstance(v, (int, float, bool, type(None))):
                return False
        widths.append(math.prod(int(s) for s in step.out.shape[len(chain.prefix) :]))
    if struct is None:
        if not entries and not gathers:
            return False
        struct = ctx.struct(sz)
    elif aligned and ctx.struct(sz) is not struct:
        return False
    if not worth_tiles(sum(shared.values())):
        return False
    total = struct.total
    rows = max(1, TILE_ELEMENTS // max(1, *widths))
    if total <= rows:
        return False  # one tile: the ordinary path is the same work
    tiled = [k - chain.start for k in chain.members]
    tiles: dict[int, list[Tensor]] = {i: [] for i in chain.exported}
    # split, not slices: the backward of one split is one cat, that of a slice a
    # zero-filled gradient of the whole input per tile
    pieces = {i: t.split(rows) for i, t in entries.items()}
    # a gathered operand's tile is its rows of the tile's result rows (index_select:
    # the backward adds into the operand's small gradient)
    gathered = {i: g[1].split(rows) for i, g in gathers.items()}
    for tile in range((total + rows - 1) // rows):
        local: dict[int, Any] = {i: p[tile] for i, p in pieces.items()}
        for i, (source, _, finish) in gathers.items():
            local[i] = finish(take_rows(source, gathered[i][tile]))

        def pick(a: Any, local: dict[int, Any] = local) -> Any:
            if isinstance(a, Ref) and a.index in local:
                return local[a.index]
            if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
                return type(a)(pick(v) for v in a)
            if isinstance(a, Ref):
                return resolve(a)
            return a

        for offset in tiled:
            step = steps[offset]
            args = tuple(pick(a) for a in step.args)
            if step.target.overloadpacket in ROW_REDUCTIONS:
                args = (args[0], _reduced_dims(step), *args[2:])
            kwargs = {k: pick(v) for k, v in step.kwargs.items()} if step.kwargs else {}
            out = step.target(*args, **kwargs)
            if out.dtype != step.out.dtype:
                out = out.to(step.out.dtype)
            local[base + offset] = out
            if base + offset in tiles:
                tiles[base + offset].append(out)
            for index in chain.drops[chain.start + offset]:
                local.pop(index, None)
    for offset in tiled:
        step, index = steps[offset], base + offset
        if index in tiles:
            shape = step.out.shape
            layout = canonical_layout(len(shape), tuple(range(len(chain.prefix))))
            values[index] = RaggedB(torch.cat(tiles[index]), layout, sz, struct)
        else:
            values[index] = None
    return True


def _sizes(steps: list[Step], chain: Chain) -> list[Sz]:
    shape = steps[-1].out.shape
    return list(shape[: len(chain.prefix)])


__all__ = [
    "BROADCAST_OPS",
    "drops_of",
    "MIN_CHAIN",
    "ROW_OPS",
    "TILE_ELEMENTS",
    "Chain",
    "chains",
    "run_chain",
]
