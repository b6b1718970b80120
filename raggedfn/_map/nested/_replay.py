"""Run a record of ``f`` on the whole nested batch.

Batch nodes run their op one level deeper on the batch. Each run of consecutive
per-sample nodes (torch code on per-sample dense tensors) is one segment: a function
of the per-sample values it reads (and the tensors ``f`` captured, shared), run by a
one-level ``map`` over the documents, so torch code on dense per-sample results is
batched by ``map``'s own rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor
from torch.utils import _pytree as pytree

from ..._errors import RaggedError
from ..._ragged import Ragged
from ._stand_ins import Node, NotRecordable, Ref, tree_leaves, tree_map


@dataclasses.dataclass(frozen=True)
class Shared:
    """A tensor ``f`` captured, by position among a segment's shared arguments."""

    index: int


@dataclasses.dataclass(frozen=True)
class Captured:
    """Inside ``torch.compile``, a tensor of a record that is not the sample's, by where
    the compiled region has it: ``"arg"`` (a leaf of ``map``'s arguments), ``"lifted"``
    (a tensor ``f`` captures, a slot of its dependency check) or ``"made"`` (a result of
    torch code ``f`` ran on those, ``_outer.py``)."""

    kind: str
    index: int


class Step(NamedTuple):
    """A batch node, or a segment with the refs it reads and its shared values."""

    node: Node | None
    segment: Segment | None
    inputs: tuple[Ref, ...]
    shared: tuple[Any, ...]


def _leaf(value: Any) -> bool:
    return isinstance(value, (Ragged, Ref, Shared))


class Segment:
    """Per-sample nodes as one function of per-sample values (for a one-level map).

    Holds no tensors (they are shared arguments), so ``map`` keys its cache on the
    nodes' values and finds it warm on the next call of the same ``f``."""

    def __init__(self, nodes: tuple[Node, ...], inputs: tuple[Ref, ...], outputs: tuple[Ref, ...]):
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        count = len(self.inputs)
        env: dict[Ref, Any] = dict(zip(self.inputs, args[:count], strict=True))
        shared = args[count:]

        def fill(value: Any) -> Any:
            if isinstance(value, Ref):
                return env[value]
            if isinstance(value, Shared):
                return shared[value.index]
            return value

        for node in self.nodes:
            node_args, node_kwargs = tree_map(fill, (node.args, node.kwargs))
            out = node.fn(*node_args, **node_kwargs)
            _bind(node.out, out, env)
        return tuple(env[ref] for ref in self.outputs)


def _bind(template: Any, out: Any, env: dict[Ref, Any]) -> None:
    refs = pytree.tree_leaves(template, is_leaf=_leaf)
    values = pytree.tree_leaves(out, is_leaf=lambda v: isinstance(v, Ragged))
    for ref, value in zip(refs, values, strict=True):
        if isinstance(ref, Ref):
            env[ref] = value


def _is_ref(value: Any) -> bool:
    return isinstance(value, Ref)


def _segment(nodes: list[Node], later: set[Ref]) -> tuple[Segment, tuple[Ref, ...], list[Any]]:
    """The segment of ``nodes``, the refs it reads from outside and its shared tensors
    (or where a compiled region has them: ``Captured``)."""
    defined: set[Ref] = set()
    inputs: list[Ref] = []
    shared: list[Any] = []
    ids: dict[Any, int] = {}
    rewritten = []

    def lift(value: Any) -> Any:
        if isinstance(value, Ref):
            if value not in defined and value not in inputs:
                inputs.append(value)
            return value
        if isinstance(value, (Tensor, Captured)):
            key = value if isinstance(value, Captured) else id(value)
            if key not in ids:
                ids[key] = len(shared)
                shared.append(value)
            return Shared(ids[key])
        return value

    for node in nodes:
        node_args, node_kwargs = tree_map(lift, (node.args, node.kwargs))
        rewritten.append(node._replace(args=tuple(node_args), kwargs=dict(node_kwargs)))
        defined.update(r for r in pytree.tree_leaves(node.out, is_leaf=_leaf) if isinstance(r, Ref))
    outputs = tuple(sorted(defined & later))
    return Segment(tuple(rewritten), tuple(inputs), outputs), tuple(inputs), shared


def _reads(node: Node) -> set[Ref]:
    return {v for v in tree_leaves((node.args, node.kwargs)) if isinstance(v, Ref)}


def steps(nodes: list[Node], output: Any) -> list[Step]:
    """The record as steps: each batch node, and each run of per-sample nodes as one
    segment (``output``: ``f``'s output template)."""
    wanted = [{r for r in pytree.tree_leaves(output, is_leaf=_leaf) if isinstance(r, Ref)}]
    for node in reversed(nodes):  # refs read by each node or after it
        wanted.append(wanted[-1] | _reads(node))
    wanted.reverse()  # wanted[i]: read by nodes[i:] or the output
    out: list[Step] = []
    i = 0
    while i < len(nodes):
        if nodes[i].kind == "batch":
            out.append(Step(nodes[i], None, (), ()))
            i += 1
            continue
        end = i
        while end < len(nodes) and nodes[end].kind == "sample":
            end += 1
        segment, inputs, shared = _segment(nodes[i:end], wanted[end])
        out.append(Step(None, segment, inputs, tuple(shared)))
        i = end
    return out


def replay(
    nodes: list[Node],
    env: dict[Ref, Any],
    output: Any,
    run_segment: Callable[[Segment, tuple[Any, ...], list[Tensor]], tuple[Any, ...]],
    batched: dict[str, int],
) -> Any:
    """The batched output of the record (``output``: ``f``'s output template)."""
    for step in steps(nodes, output):
        node, segment = step.node, step.segment
        if node is not None:
            node_args, node_kwargs = tree_map(
                lambda v: env[v] if isinstance(v, Ref) else v, (node.args, node.kwargs)
            )
            try:
                result = node.fn(*node_args, **node_kwargs)
            except RaggedError as error:  # the op refuses the nested batch: the loop's turn
                raise NotRecordable(f"raggedfn.{node.fn.__name__} on the batch: {error}") from None
            _bind(node.out, result, env)
            name = f"raggedfn.{node.fn.__name__}"
            batched[name] = batched.get(name, 0) + 1
            continue
        assert segment is not None
        outs = run_segment(segment, tuple(env[r] for r in step.inputs), list(step.shared))
        for ref, value in zip(segment.outputs, outs, strict=True):
            env[ref] = value
    return tree_map(lambda v: env[v] if isinstance(v, Ref) else v, output)
