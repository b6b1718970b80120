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
do not depend on the sample (weights) enter as they are. Values of the chain that
later steps or the outputs read are joined with one ``cat``; the rest live only
inside a tile. Anything the tile runner does not expect sends the chain back to the
ordinary step-by-step path.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._sizes import Sz
from ._steps import Plan, Ref, Step, TSpec, refs
from ._values import RaggedB, canonical_layout

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


class Chain:
    __slots__ = ("exported", "prefix", "rank", "start", "stop")

    def __init__(self, start: int, stop: int, prefix: tuple[str, ...]) -> None:
        self.start = start  # steps start..stop-1
        self.stop = stop
        self.prefix = prefix  # keys of the leading ragged sizes
        self.exported: set[int] = set()  # chain steps whose values are read after it


def _prefix(spec: Any) -> tuple[str, ...] | None:
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
    for index in read:
        spec = spec_of(index)
        if isinstance(spec, TSpec) and spec.ragged and _prefix(spec) != prefix:
            return None
    return prefix


def _row_op(step: Step) -> tuple[str, ...] | None:
    if not step.batched or step.slot is not None or step.random or step.defines:
        return None
    if step.rebind or step.getitem:
        return None
    packet = getattr(step.target, "overloadpacket", None)
    prefix = _prefix(step.out)
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
    prefix = _prefix(step.out)
    dense = rank - len(prefix or ())
    if any(d < -dense for d in out):
        return None
    return out


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
        stop = k + 1
        while stop < len(steps):
            nxt = steps[stop]
            if nxt.slot is not None or not nxt.batched:
                stop += 1  # a weight read or prepared between the ops: no sample in it
                continue
            if _row_local(nxt) != prefix:
                break
            stop += 1
        while stop > k and _row_local(steps[stop - 1]) is None:
            stop -= 1  # end on an op of the chain
        members = sum(1 for s in steps[k:stop] if _row_local(s) is not None)
        if members >= MIN_CHAIN:
            chain = Chain(k, stop, prefix)
            inside = range(count + k, count + stop)
            later: set[int] = set()
            for s in steps[stop:]:
                refs(s.args, later)
                refs(s.kwargs, later)
                later.update(s.rebind or ())
            for o in plan.outputs:
                refs(o, later)
            chain.exported = {i for i in inside if i in later}
            found[k] = chain
        k = max(stop, k + 1)
    plan._row_chains = (count, found)  # type: ignore[attr-defined]
    return found


def run_chain(
    plan: Plan, chain: Chain, values: list[Any], count: int, resolve: Any, run_plain: Any
) -> bool:
    """Run ``chain`` on row tiles, writing its values into ``values``; False (nothing
    written) when its operands are not what tiles need. ``run_plain(k)`` runs step
    ``k`` the ordinary way (a weight read between the chain's ops)."""
    steps = plan.steps[chain.start : chain.stop]
    base = count + chain.start
    struct = None
    widths: list[int] = []
    entries: dict[int, Tensor] = {}
    for step in steps:
        if step.slot is not None or not step.batched:
            continue
        read: set[int] = set()
        refs(step.args, read)
        refs(step.kwargs, read)
        for index in read:
            if base <= index < count + chain.stop:
                continue
            v = values[index]
            if isinstance(v, RaggedB):
                ragged = len(v.sz)
                if v.layout != canonical_layout(len(v.shape()), tuple(range(ragged))):
                    return False
                if tuple(s.key for s in v.sz) != chain.prefix:
                    return False
                if struct is None:
                    struct = v.struct
                elif v.struct is not struct:
                    return False
                entries[index] = v.values
            elif isinstance(v, Tensor):
                dense = len(step.out.shape) - len(chain.prefix)
                if step.target.overloadpacket is not aten.linear and v.ndim > dense:
                    return False  # it would broadcast along a ragged axis
            elif not isinstance(v, (int, float, bool, type(None))):
                return False
        widths.append(math.prod(int(s) for s in step.out.shape[len(chain.prefix) :]))
    if struct is None:
        return False
    total = struct.total
    rows = max(1, TILE_ELEMENTS // max(1, *widths))
    if total <= rows:
        return False  # one tile: the ordinary path is the same work
    # steps that do not depend on the sample (a captured weight) run once, first
    plain = [o for o, step in enumerate(steps) if step.slot is not None or not step.batched]
    for offset in plain:
        run_plain(chain.start + offset)
    tiled = [o for o in range(len(steps)) if o not in plain]
    tiles: dict[int, list[Tensor]] = {i: [] for i in chain.exported}
    # split, not slices: the backward of one split is one cat, that of a slice a
    # zero-filled gradient of the whole input per tile
    pieces = {i: t.split(rows) for i, t in entries.items()}
    for tile in range((total + rows - 1) // rows):
        local: dict[int, Any] = {i: p[tile] for i, p in pieces.items()}

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
    sz = tuple(_sizes(steps, chain))
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


__all__ = ["MIN_CHAIN", "ROW_OPS", "TILE_ELEMENTS", "Chain", "chains", "run_chain"]
