"""Widening a plan's guards with a later trace that runs the same ops.

A plan traced on large example sizes often holds a guard that excludes a size only
because some code compared it (Hugging Face's ``q_length > 1 and ... and is_causal``
records ``s > 1`` even where the branch cannot change anything), so a sample of one row
gets a plan of its own, traced with that size fixed (``s = 1``): every axis of that size
becomes a fixed one, and ops that merge or split it run per sample.

That later trace is exact for the samples meeting its guards. When the first plan, with
the later trace's fixed sizes put in, is the same sequence of ops with the same
arguments and the same output shapes (sizes folded to numbers on both sides), the first
plan computes, for those samples, what the later trace computes: the batching rules run
each op per sample for any sizes. The samples then run on the first plan, batched with
the others, under the later trace's guards plus every guard of the first plan that still
depends on a size left free (:func:`widen`). Anything the comparison does not know makes
it refuse: the samples keep the later trace as a plan of their own.
"""

from __future__ import annotations

import math
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
from torch import Tensor

from ..base._sizes import Evaluator, Sz
from ..base._steps import Plan, Ref, TSpec

# ops whose result has the values of their first argument (layouts aside)
_IDENTITIES = (torch.ops.aten.contiguous.default,)


class _Differs(Exception):
    """The plans differ (or the comparison cannot tell)."""


def widen(
    general: Plan, special: Plan, sizes: dict[str, int]
) -> list[tuple[str, Evaluator]] | None:
    """The guards under which a sample may run on ``general`` instead of ``special`` (a
    trace on the sizes ``sizes`` of a sample that breaks a guard of ``general``, keyed by
    ``general``'s symbol names), or ``None`` when that is not proven."""
    if (
        general.pinned
        or general.late
        or special.late
        or special.unknown
        or general.fixed
        or len(general.guard_exprs) != len(general.guards)
        or len(special.guard_exprs) != len(special.guards)
        or general.placeholders != special.placeholders
        or [k.kind for k in general.leaf_kinds] != [k.kind for k in special.leaf_kinds]
        or general.out_spec != special.out_spec
        or any(s.defines for p in (general, special) for s in p.steps)
    ):
        return None
    rename: dict[str, str] = {}
    for g, s in zip(general.leaf_kinds, special.leaf_kinds, strict=True):
        if len(g.symbols) != len(s.symbols):
            return None
        for a, b in zip(g.symbols, s.symbols, strict=True):
            if rename.setdefault(b, a) != a:
                return None
    names = {v: k for k, v in rename.items()}  # general's name -> special's
    if set(names) != set(rename.values()):
        return None
    fixed: dict[Any, int] = {}
    for name, value in special.fixed.items():
        if name not in rename:
            return None
        fixed[sympy.Symbol(rename[name], integer=True)] = value
    try:
        mine = _canonical(general, fixed, {})
        theirs = _canonical(special, {}, rename)
    except _Differs:
        return None
    if len(mine) != len(theirs) or not all(_same(a, b) for a, b in zip(mine, theirs, strict=True)):
        return None
    # ``special``'s guards make it exact; ``general``'s own guards that the traced sample
    # meets are kept too (only those it breaks are what this widening is about)
    kept = list(special.guards)
    for guard in general.guards:
        try:
            holds = guard[1](sizes)  # type: ignore[arg-type]  # ints evaluate as well
        except Exception:  # a size this env lacks: cannot tell
            return None
        if holds is True or (holds is not False and bool(holds)):
            kept.append(guard)
    return kept


def _substitute(expr: Any, fixed: dict[Any, int]) -> Any:
    by_name = {s.name: v for s, v in fixed.items()}
    return expr.xreplace({s: by_name[s.name] for s in expr.free_symbols if s.name in by_name})


def _canonical(plan: Plan, fixed: dict[Any, int], rename: dict[str, str]) -> list[Any]:
    """``plan`` as comparable entries: numbers for every value that is a number once the
    ``fixed`` sizes are put in, references renumbered past the folded steps, sizes as
    sympy expressions over the general plan's symbol names."""
    where: dict[int, Any] = {i: ("input", i) for i in range(len(plan.placeholders))}
    entries: list[Any] = []

    def size(value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, Sz):
            if value.expr is None:
                if value.const is not None:
                    return int(value.const)
                raise _Differs
            expr = value.expr
            if rename:
                expr = expr.xreplace(
                    {
                        s: sympy.Symbol(rename.get(s.name, s.name), integer=True)
                        for s in expr.free_symbols
                    }
                )
            expr = sympy.expand(_substitute(expr, fixed))
            if not expr.free_symbols:
                if expr.is_Integer:
                    return int(expr)
                if expr.is_Float or expr.is_Rational:
                    return float(expr)
                raise _Differs
            return ("size", str(expr))
        raise _Differs

    def spec(out: Any) -> Any:
        if isinstance(out, TSpec):
            return ("tensor", tuple(size(s) for s in out.shape), out.dtype)
        if isinstance(out, (tuple, list)):
            return tuple(spec(o) for o in out)
        if out is None or isinstance(out, (bool, int, float, Sz)):
            return size(out) if isinstance(out, (int, Sz)) else out
        raise _Differs

    def arg(a: Any) -> Any:
        if isinstance(a, Ref):
            return where[a.index]
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            return (type(a).__name__, tuple(arg(v) for v in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        return ("value", a)

    written = {i for step in plan.steps for i in step.rebind or ()}
    for step in plan.steps:
        if (
            step.target in _IDENTITIES
            and type(step.args[0]) is Ref
            and not {step.index, step.args[0].index} & written
        ):
            # a copy for a layout only (a traced ``contiguous`` that an example of
            # another size did not need): the same values, as long as neither is
            # written in place (the copy is what keeps a write from the original)
            where[step.index] = where[step.args[0].index]
            continue
        out = spec(step.out)
        if step.slot is None and (
            isinstance(out, (int, bool)) or (isinstance(out, float) and step.batched)
        ):
            # a size or number, the same in every sample: as the literal the other
            # trace has in its place
            where[step.index] = ("value", out)
            continue
        where[step.index] = ("node", len(entries))
        entries.append(
            (
                step.target,
                step.slot,
                step.random,
                step.getitem,
                None if step.rebind is None else tuple(where[i] for i in step.rebind),
                arg(step.args),
                arg(step.kwargs),
                out,
            )
        )
    entries.append(("outputs", arg(tuple(plan.outputs))))
    return entries


def _same(a: Any, b: Any) -> bool:
    """Equal entries: values of the same type and contents (tensors by metadata and
    contents, floats with NaN equal to NaN)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and (a is b or _same_tensor(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    try:
        return bool(a == b)
    except Exception:  # an object without a usable equality: cannot tell
        return a is b


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    if (
        a.shape != b.shape
        or a.dtype != b.dtype
        or a.device != b.device
        or a.layout != b.layout
        or a.requires_grad != b.requires_grad
        or type(a) is not torch.Tensor
        or type(b) is not torch.Tensor
        or a.numel() > 4096
    ):
        return False
    return bool(torch.equal(a, b))


__all__ = ["widen"]
