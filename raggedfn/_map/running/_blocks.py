"""Row blocks: a pair-state chain run per sample on cache-sized blocks of its rows.

A per-sample block ``p = s[:, None] + s[None]; p = p + W2 gelu(W1 p); a =
softmax(p.sum(-1), -1); a @ s`` is row-local along the sample's first axis: row ``i``
of every value needs row ``i`` of the others and whole per-sample operands (``s[None]``,
the ``s`` of ``a @ s``) only. Run op by op on the packed batch, its ``sum N_i^2 x 4C``
intermediates fall out of the CPU caches; run as the per-sample loop, a large sample's
``N^2 x 4C`` block does too. Here each sample's rows are cut into blocks whose widest
value holds about :data:`TILE_ELEMENTS` elements, and every op of the chain runs on a
block exactly as the loop runs it on the sample (the same aten call on the sample's
tensors, sliced along the first axis): the loop's ops, the loop's results, in cache.

A chain is a run of consecutive plan steps whose results have the same ragged first
axis and only leading ragged axes, at least one of them a pair state (two ragged axes
or more; token chains keep the flat tiles of :mod:`._tiles`), each an op in
:data:`BLOCK_OPS` whose operands are *aligned* (first axis the chain's, sliced with the
block) or *whole* (broadcast along that axis, or the right operand of a 2-d ``matmul``:
read per sample). Steps between its ops that read none of its values run first. Values
that later steps read are joined with one ``cat`` in sample and row order, which is
the packed order of a value whose ragged axes lead.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..._errors import fail
from ..base._sizes import Sz
from ..base._steps import Plan, Ref, Step, TSpec, refs
from ..base._values import Ctx, DenseB, RaggedB, canonical_layout, info_of
from ._tiles import (
    BROADCAST_OPS,
    ROW_OPS,
    ROW_REDUCTIONS,
    drops_of,
    hoistable,
    ragged_prefix,
    read_after,
    worth_tiles,
)

aten = torch.ops.aten

# elements of the widest value of one block (2 MiB of float32: measured best of 2^17-2^22
# on benchmarks/pair_state.py, B = 8 and 32, fwd and fwd+bwd, 1 thread)
TILE_ELEMENTS = 1 << 19
MIN_CHAIN = 3
# False: pair-state chains take the flat tiles of _tiles.py (tests force either path)
ENABLED = True
# blocks only when a sample's widest value averages >= TILE_ELEMENTS / MIN_FILL elements:
# below, the Python loop over samples costs more than the caches save (the chain of
# benchmarks/pair_state.py, C = 32, 1 thread, blocks / op by op: 2.4x at 8K elements per
# sample (B = 64), 1.3x at 34K (B = 256), 0.87x at 220K (B = 32), 0.68x at 2.6M (B = 8))
MIN_FILL = 8
LAST_AXIS_OPS = frozenset({aten.softmax, aten.log_softmax, aten._softmax, aten._log_softmax})
BLOCK_OPS = ROW_OPS | BROADCAST_OPS | ROW_REDUCTIONS | LAST_AXIS_OPS | {aten.matmul}
_PLAIN_ARGS = (int, float, bool, type(None), torch.dtype)


class Block:
    __slots__ = ("drops", "exported", "lead", "members", "roles", "start", "stop")

    def __init__(self, start: int, stop: int, lead: str, members: list[int]) -> None:
        self.start = start
        self.stop = stop
        self.lead = lead  # key of the ragged first axis every member's result has
        self.members = members
        # (step, value index) -> "rows" (sliced with the block) or "whole" (per sample)
        self.roles: dict[tuple[int, int], str] = {}
        self.exported: set[int] = set()
        self.drops: dict[int, tuple[int, ...]] = {}  # see _tiles.drops_of


def _lead(spec: Any) -> str | None:
    prefix = ragged_prefix(spec)
    return prefix[0] if prefix else None


def _plain(a: Any) -> bool:
    if isinstance(a, Ref):
        return True
    if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        return all(_plain(v) for v in a)
    return isinstance(a, _PLAIN_ARGS)


def _member_roles(step: Step, lead: str, spec_of: Any, inside: set[int]) -> dict[int, str] | None:
    """How a step of a chain led by ``lead`` reads each batched operand, or None when
    it cannot run on row blocks."""
    if not step.batched or step.slot is not None or step.random or step.defines:
        return None
    if step.rebind or step.getitem or not isinstance(step.out, TSpec):
        return None
    packet = getattr(step.target, "overloadpacket", None)
    if packet not in BLOCK_OPS or _lead(step.out) != lead:
        return None
    if not all(_plain(a) for a in step.args) or not all(_plain(v) for v in step.kwargs.values()):
        return None
    n = len(step.out.shape)
    nested: set[int] = set()
    for a in (*step.args, *step.kwargs.values()):
        if isinstance(a, (list, tuple)):
            refs(a, nested)
    if nested:
        return None  # a list of values (cat): not a block op
    if packet in ROW_REDUCTIONS | LAST_AXIS_OPS:
        dims = step.args[1] if len(step.args) > 1 else step.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else dims
        rank = len(spec_of(step.args[0].index).shape) if isinstance(step.args[0], Ref) else 0
        if not isinstance(dims, (list, tuple)) or not dims or rank == 0:
            return None  # a reduction over every axis
        if any(d % rank == 0 for d in dims):
            return None  # along the first axis: the block does not hold it
    operands = [(p, a) for p, a in enumerate(step.args) if isinstance(a, Ref)]
    operands += [(-1, v) for v in step.kwargs.values() if isinstance(v, Ref)]
    roles: dict[int, str] = {}
    for position, ref in operands:
        role = _role(packet, position, spec_of(ref.index), n, lead)
        if role is None or (role != "rows" and ref.index in inside):
            return None  # a value of the chain exists only block by block
        if roles.get(ref.index, role) != role:
            return None
        roles[ref.index] = role
    return roles


def _role(packet: Any, position: int, spec: Any, n: int, lead: str) -> str | None:
    """``rows``: sliced with the block; ``whole``: the sample's whole value; ``shared``:
    as it is (the same for every sample) or the sample's (a fixed-shape per-sample
    value); None: not a block operand."""
    if isinstance(spec, Sz):
        return None  # a per-sample number
    if not isinstance(spec, TSpec):
        return "shared"  # a Python number
    m = len(spec.shape)
    first = spec.shape[0] if m else None
    weight = (packet is aten.linear and position in (1, 2)) or (
        packet is aten.matmul and position == 1
    )
    if packet is aten.matmul and (n != 2 or m != 2):
        return None
    if not spec.ragged:
        if weight or m < n or first == 1:
            return "shared"
        return None
    leads = isinstance(first, Sz) and first.key == lead
    if packet in BROADCAST_OPS:
        if leads and m == n and position in (0, 1, -1):
            return "rows"  # (of rank n: a lower rank broadcasts along the first axis)
    elif leads and position == 0:
        return "rows"  # the one data operand (a reduction, a softmax: not over axis 0)
    if packet is aten.matmul and position == 1:
        return "whole"
    if packet in BROADCAST_OPS and position in (0, 1) and (m < n or first == 1 or _is_one(first)):
        return "whole"  # broadcast along the first axis
    return None


def _is_one(size: Any) -> bool:
    return isinstance(size, Sz) and size.const == 1


def blocks(plan: Plan, count: int) -> dict[int, Block]:
    """Block chains of ``plan`` (run with ``count`` inputs) by their first step (cached)."""
    cached = getattr(plan, "_row_blocks", None)
    if cached is not None and cached[0] == count:
        return cached[1]
    steps = plan.steps

    def spec_of(index: int) -> Any:
        if index < count:
            return plan.inputs[index] if index < len(plan.inputs) else None
        return steps[index - count].out

    found: dict[int, Block] = {}
    k = 0
    while k < len(steps):
        lead = _lead(steps[k].out) if isinstance(steps[k].out, TSpec) else None
        first = _member_roles(steps[k], lead, spec_of, set()) if lead else None
        if first is None or lead is None:
            k += 1
            continue
        members, inside = [k], {count + k}
        roles = {(k, i): r for i, r in first.items()}
        stop = k + 1
        while stop < len(steps):
            nxt = steps[stop]
            if nxt.slot is not None or not nxt.batched:
                stop += 1
                continue
            found_roles = _member_roles(nxt, lead, spec_of, inside)
            if found_roles is not None:
                members.append(stop)
                inside.add(count + stop)
                roles.update({(stop, i): r for i, r in found_roles.items()})
            elif not hoistable(nxt, inside):
                break
            stop += 1
        stop = members[-1] + 1
        pairs = any(len(ragged_prefix(steps[j].out) or ()) >= 2 for j in members)
        if len(members) >= MIN_CHAIN and pairs:
            block = Block(k, stop, lead, members)
            block.roles = roles
            block.exported = read_after(plan, stop, inside)
            block.drops = drops_of(plan, count, members)
            found[k] = block
        k = max(stop, k + 1)
    plan._row_blocks = (count, found)  # type: ignore[attr-defined]
    return found


def _per_sample(v: RaggedB) -> list[Tensor] | None:
    """Each sample's logical tensor (views of the packed values), or None (nested)."""
    info = info_of(v.layout)
    if any(a.ragged and a.nested for a in info.axes):
        return None
    sizes = v.struct.sizes.tolist()
    dense = list(v.values.shape[1:])
    counts = [math.prod(s) for s in sizes]
    ragged = len(info.ragged)
    order = [a.index if a.ragged else ragged + a.index for a in info.axes]
    identity = order == sorted(order)
    out = []
    for piece, size in zip(v.values.split(counts), sizes, strict=True):
        t = piece.view(*size, *dense)
        out.append(t if identity else t.permute(order))
    return out


def _pick(
    a: Any,
    where: tuple[int, int, int, int],
    local: dict[int, Tensor],
    samples: dict[int, Any],
    roles: dict[tuple[int, int], str],
    resolve: Any,
) -> Any:
    """The argument of step ``k`` on rows ``i0:i1`` of sample ``b`` (``where``)."""
    if isinstance(a, Ref):
        if a.index in local:
            return local[a.index]
        if a.index in samples:
            k, b, i0, i1 = where
            if roles[(k, a.index)] == "rows":
                return samples[a.index][b][i0:i1]
            return samples[a.index][b]
        return resolve(a)
    if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        return type(a)(_pick(v, where, local, samples, roles, resolve) for v in a)
    return a


def _extents(ctx: Ctx, steps: list[Step], block: Block) -> tuple[list[int], list[int]]:
    """Per sample: rows along the block's first axis and the widest member value's
    elements per row (one host sync)."""
    batch = ctx.batch_size
    lead_sz = next(s for s in steps[block.start].out.shape[:1])
    widths: list[Any] = []
    for k in block.members:
        width: Any = 1
        for s in steps[k].out.shape[1:]:
            width = width * (ctx.eval(s).clamp(min=0) if isinstance(s, Sz) else int(s))
        widths.append(width if isinstance(width, Tensor) else torch.full((batch,), width))
    table = torch.stack([ctx.eval(lead_sz).clamp(min=0), torch.stack(widths).amax(0)])
    rows_of, width_of = table.tolist()
    return rows_of, width_of


def _fills(table: tuple[list[int], list[int]], batch: int) -> bool:
    """Whether the samples have rows and are large enough for blocks (``MIN_FILL``)."""
    total = sum(r * w for r, w in zip(*table, strict=True))
    return total > 0 and total >= batch * (TILE_ELEMENTS // MIN_FILL)


def run_block(
    ctx: Ctx,
    plan: Plan,
    block: Block,
    values: list[Any],
    count: int,
    resolve: Any,
    run_plain: Any,
) -> bool | None:
    """Run the steps of ``block`` that are not its members (``run_plain``), then its
    members per sample on row blocks, writing their values into ``values``. None: nothing
    run, samples too small or without rows (the caller may take the flat tiles, or op
    by op, which keeps the outputs' autograd links); False: the other steps ran, the
    members did not (their operands are not what blocks need)."""
    batch = ctx.batch_size
    if batch == 0:
        return None
    try:
        table = _extents(ctx, plan.steps, block)
    except KeyError:  # a size that a step of the block defines: known once it has run
        table = None
    if table is not None and not _fills(table, batch):
        return None
    for k in range(block.start, block.stop):
        if k not in block.members:
            run_plain(k)
    if table is None:
        table = _extents(ctx, plan.steps, block)
        if not _fills(table, batch):
            return False
    steps = plan.steps
    rows_of, width_of = table
    samples: dict[int, Any] = {}
    shared: dict[int, int] = {}  # elements of the tensors every block reads (weights)
    for (_, index), role in block.roles.items():
        if index in samples or index - count in block.members:
            continue
        v = values[index]
        if isinstance(v, RaggedB) and role != "shared":
            per = _per_sample(v)
            if per is None or len(per) != batch:
                return False
            samples[index] = per
        elif isinstance(v, DenseB) and role == "shared":
            samples[index] = list(v.data.unbind(0))
        elif isinstance(v, (RaggedB, DenseB)) or (role != "shared" and v is not None):
            return False
        elif isinstance(v, Tensor):
            shared[index] = v.numel()
    if not worth_tiles(sum(shared.values()), TILE_ELEMENTS):
        return False
    tiles: dict[int, list[Tensor]] = {i: [] for i in block.exported}
    for b in range(batch):
        rows = rows_of[b]
        step_rows = max(1, TILE_ELEMENTS // max(1, width_of[b]))
        for i0 in range(0, rows, step_rows):
            i1 = min(rows, i0 + step_rows)
            local: dict[int, Tensor] = {}
            for k in block.members:
                step = steps[k]

                where = (k, b, i0, i1)
                args = tuple(
                    _pick(a, where, local, samples, block.roles, resolve) for a in step.args
                )
                kwargs = {
                    n: _pick(v, where, local, samples, block.roles, resolve)
                    for n, v in step.kwargs.items()
                }
                out = step.target(*args, **kwargs)
                if out.dtype != step.out.dtype:
                    out = out.to(step.out.dtype)
                local[count + k] = out
                if count + k in tiles:
                    tiles[count + k].append(out)
                for index in block.drops[k]:
                    local.pop(index, None)
    for k in block.members:
        index = count + k
        if index not in tiles:
            values[index] = None
            continue
        spec = steps[k].out
        ragged = len(ragged_prefix(spec) or ())
        dense = [int(s) for s in spec.shape[ragged:]]
        parts = [t.reshape(-1, *dense) for t in tiles[index]]
        joined = (
            torch.cat(parts)
            if parts
            else torch.empty(0, *dense, dtype=spec.dtype, device=ctx.device)
        )
        sz = tuple(spec.shape[:ragged])
        struct = ctx.struct(sz)
        if joined.shape[0] != struct.total:
            raise fail("map", f"row blocks of {steps[k].op} gave {joined.shape[0]} rows")
        layout = canonical_layout(len(spec.shape), tuple(range(ragged)))
        values[index] = RaggedB(joined, layout, sz, struct)
    return True


__all__ = ["BLOCK_OPS", "TILE_ELEMENTS", "Block", "blocks", "run_block"]
