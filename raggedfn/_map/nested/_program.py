"""A record of ``f`` kept across calls: for a compiled region, made once outside
dynamo's view (on real values), then run inside the graph being compiled on the
region's own values; eagerly (``entry/_eager_nested.py``), run by warm calls on theirs.

:func:`build` records ``f`` with :class:`._outer.Outside`, so that every tensor of the
record is named by where the region has it (``Captured``), and plans its steps (batch
nodes and segments, as eagerly). :func:`run` is plain code for dynamo to trace: the
made nodes on the region's values, then the steps, batch nodes as raggedfn ops one
level deeper on the nested batch, segments by ``run_segment`` (a one-level ``map``,
compiled as one-level map is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ..._ragged import Ragged
from ._outer import Made, Outside, Unknown, needed
from ._replay import Captured, Segment, Step, steps
from ._run import NotBatched, record
from ._stand_ins import Ref, tree_leaves, tree_map


@dataclasses.dataclass
class Program:
    """A record of ``f`` for one argument signature, with where its tensors come from."""

    leaf_refs: tuple[tuple[int, int], ...] = ()  # (ref id, argument leaf index)
    made: tuple[Made, ...] = ()
    steps: tuple[Step, ...] = ()
    output: Any = None
    failure: str | None = None  # why f cannot run batched (then nothing else is set)
    deps: Any = None  # the dependency walk of f (``_deps.Deps``), set by the caller
    fits: tuple[Any, ...] = ()  # what each argument leaf must be (set by the caller)


def build(
    f: Callable[..., Any],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    lifted_ids: dict[int, list[int]],
) -> Program:
    """Record ``f`` on stand-ins (``leaves``: real values); ``lifted_ids``: the tensors
    ``f`` captures, by id, and their slots in its dependency check. Raises
    ``NotBatched`` with the reason where the record cannot stand for ``f``."""
    known: dict[int, Captured] = {}
    keep: list[Any] = []
    for i, (leaf, kind) in enumerate(zip(leaves, kinds, strict=True)):
        if kind == "shared" and isinstance(leaf, Tensor):
            known.setdefault(id(leaf), Captured("arg", i))
            keep.append(leaf)
    for ident, slots in lifted_ids.items():
        known.setdefault(ident, Captured("lifted", slots[0]))
    outside = Outside(known, keep)
    rec, env, output = record(f, leaves, kinds, treespec, outside)
    nodes = []
    for node in rec.nodes:
        args, kwargs = tree_map(outside.name, (node.args, node.kwargs))
        for value in tree_leaves((args, kwargs)):
            if isinstance(value, Unknown):
                raise NotBatched(_unknown(value.what))
        nodes.append(node._replace(args=tuple(args), kwargs=dict(kwargs)))
    planned = steps(nodes, output)
    reads = [(s.node.args, s.node.kwargs) if s.node else s.shared for s in planned]
    try:
        made = needed(outside.made, reads)
    except LookupError as error:
        raise NotBatched(_unknown(str(error))) from None
    leaf_refs = []
    for ref, value in env.items():
        index = next(i for i, leaf in enumerate(leaves) if leaf is value)
        leaf_refs.append((ref.id, index))
    return Program(tuple(leaf_refs), tuple(made), tuple(planned), output)


def _unknown(what: str) -> str:
    return (
        f"inside torch.compile, f uses {what} that is neither an argument of map, a "
        "tensor f captures, nor made from those by torch code in f; pass it to map as "
        "an argument (in_dims=None)"
    )


def _is_ref(value: Any) -> bool:
    return isinstance(value, Ref)


def _is_out(value: Any) -> bool:
    return isinstance(value, (Ragged, Ref))


def run(
    program: Program,
    leaves: list[Any],
    lifted: list[Any],
    run_segment: Callable[[Segment, tuple[Any, ...], list[Any]], tuple[Any, ...]],
    call_batch: Callable[[Any, Any, Any], Any] | None = None,
) -> Any:
    """The batched output of ``program`` on the argument leaves and the tensors ``f``
    captures (``lifted``), as the call (or compiled region) has them; ``call_batch``:
    how a batch node's op is called (default: directly)."""
    env: dict[int, Any] = {ref: leaves[i] for ref, i in program.leaf_refs}
    made: dict[int, Any] = {}

    def fill(value: Any) -> Any:
        if isinstance(value, Ref):
            return env[value.id]
        if isinstance(value, Captured):
            if value.kind == "arg":
                return leaves[value.index]
            if value.kind == "lifted":
                return lifted[value.index]
            return made[value.index]
        return value

    for node in program.made:
        args, kwargs = tree_map(fill, (node.args, node.kwargs))
        if node.grad is None:
            out = node.fn(*args, **kwargs)
        else:  # under the grad mode f set around it
            with torch.set_grad_enabled(node.grad):
                out = node.fn(*args, **kwargs)
        for slot, value in zip(node.slots, pytree.tree_leaves(out), strict=True):
            if slot is not None:
                made[slot] = value
    for step in program.steps:
        if step.node is not None:
            args, kwargs = tree_map(fill, (step.node.args, step.node.kwargs))
            if call_batch is None:
                result = step.node.fn(*args, **kwargs)
            else:
                result = call_batch(step.node, args, kwargs)
            out = step.node.out
            if isinstance(out, Ref):  # one result (the common case: no pytree walk)
                env[out.id] = result
                continue
            refs = pytree.tree_leaves(out, is_leaf=_is_out)
            values = pytree.tree_leaves(result, is_leaf=lambda v: isinstance(v, Ragged))
            for ref, value in zip(refs, values, strict=True):
                if isinstance(ref, Ref):
                    env[ref.id] = value
            continue
        segment = step.segment
        assert segment is not None
        inputs = tuple(env[r.id] for r in step.inputs)
        outs = run_segment(segment, inputs, [fill(c) for c in step.shared])
        for ref, value in zip(segment.outputs, outs, strict=True):
            env[ref.id] = value
    if isinstance(program.output, Ref):
        return env[program.output.id]
    return pytree.tree_map(fill, program.output, is_leaf=_is_ref)


__all__ = ["Program", "build", "run"]
