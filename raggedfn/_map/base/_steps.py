"""The data of a traced plan: its steps, the references between them and the specs of
per-sample tensors. Kept apart from the tracer so that the modules that run or transform a
plan (interpreter, row tiles, chunks, fallback) read it without importing the tracer."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._sizes import Evaluator, Sz


@dataclasses.dataclass(frozen=True)
class Ref:
    """A reference to the value of plan node ``index``."""

    index: int


@dataclasses.dataclass
class TSpec:
    """Traced per-sample tensor: logical shape (int or :class:`Sz`) and dtype."""

    shape: tuple[Any, ...]
    dtype: torch.dtype

    @property
    def ragged(self) -> bool:
        return any(isinstance(s, Sz) for s in self.shape)


@dataclasses.dataclass
class Step:
    index: int
    name: str
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any  # TSpec, Sz, int/float, or a tuple of those
    batched: bool
    op: str = ""
    rule: Any = None
    getitem: bool = False
    rebind: tuple[int, ...] | None = None  # an in-place op's input and its aliases
    slot: int | None = None  # a captured tensor: its lifted slot, read at every call
    random: bool = False  # draws random numbers (batched: one draw per sample)
    defines: tuple[str, ...] = ()  # data-dependent sizes (unbacked symbols) it creates
    twin: Any = None  # the Tensor overload of a Scalar overload (for per-sample scalars)


@dataclasses.dataclass
class LeafKind:
    """How one flat input leaf enters the trace."""

    kind: str  # "ragged", "dense", "shared" or "constant"
    symbols: tuple[str, ...] = ()
    sz: tuple[Sz, ...] = ()


@dataclasses.dataclass
class Plan:
    steps: list[Step]
    placeholders: list[int]  # flat leaf index of each placeholder (constants are baked in)
    leaf_kinds: list[LeafKind]
    outputs: list[Any]
    out_spec: Any
    guards: list[tuple[str, Evaluator]]
    trace_seconds: float
    lifted: dict[int, int]  # step index of a captured tensor -> its lifted slot
    unknown: list[str]  # captured tensors found nowhere raggedfn looks (see _deps)
    pinned: bool = False  # a guard fixed a ragged size to a constant (len(t), int(n), n == 5)
    # guards on data-dependent sizes (torch._check of a nonzero count): checked as soon
    # as the steps defining those sizes have run, (text, evaluator, size names)
    late: list[tuple[str, Evaluator, frozenset[str]]] = dataclasses.field(default_factory=list)
    # texts of the guards recorded by torch's own code (not f's): under compile, where
    # no sample can run per sample, samples without elements may break them
    internal: frozenset[str] = frozenset()
    inputs: list[Any] = dataclasses.field(default_factory=list)  # specs of the placeholders
    warned: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    # the sympy expression of each guard (parallel to ``guards``), for plan-time reasoning
    guard_exprs: list[Any] = dataclasses.field(default_factory=list)
    # ragged sizes the trace took as fixed (a guard pins each): symbol name -> value
    fixed: dict[str, int] = dataclasses.field(default_factory=dict)
    # more guard sets, each enough for a sample to run on this plan: those of a later
    # trace on other sizes proven to run the same ops (see ``caching/_widen.py``)
    alternatives: list[list[tuple[str, Evaluator]]] = dataclasses.field(default_factory=list)


def refs(a: Any, out: set[int]) -> None:
    """Add to ``out`` the node indices that ``a`` (a step's args or kwargs, nested in lists,
    tuples and dicts; named tuples are constants) refers to."""
    if isinstance(a, Ref):
        out.add(a.index)
    elif isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        for v in a:
            refs(v, out)
    elif isinstance(a, dict):
        for v in a.values():
            refs(v, out)
