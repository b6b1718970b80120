"""A plan prepared for warm calls: the static parts of each step resolved once.

:func:`interpret.run` decides at every call and for every step what kind of step it is
(a captured tensor, a per-sample size, a ``getitem``, a random op, an op with a batching
rule), resolves its arguments by walking them, and asks whether any is batched. For a
plan that runs op by op (no guards, no tiles or blocks, no in-place rebinding, no
data-dependent sizes) all of that is fixed by the plan: :func:`prepared` turns each step
into one closure that does only the per-call part, and :func:`run_prepared` runs them
in a straight loop. What a closure cannot settle from the plan alone (whether an
operand is batched at this call, whether the pointwise shortcut's operands line up) it
still checks, and anything unexpected goes through the general ``_run_step``: the same
code, so the same answer, warnings and errors.

Built and used only eagerly (a memo on the plan is a side effect dynamo would guard on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as pytree

from ..base._sizes import Sz, Unsupported
from ..base._steps import Plan, Ref, Step
from ..base._values import BATCHED, Ctx, RaggedB, SymB
from ..rules import _lazy_pairs, _pointwise
from ..running import _blocks
from ..running._fallback import to_output
from ..running._interpret import after_rule, last_uses, run_step
from ..running._interpret import resolve_in as resolve
from ..running._tiles import chains

StepFn = Callable[[Ctx, list[Any], bool], Any]


class Prepared:
    """The closures of one plan: ``steps`` as ``(value index, closure, indices to
    release after it)``, and the closure that builds the result."""

    def __init__(self, plan: Plan, count: int) -> None:
        frees = last_uses(plan, count)
        self.count = count
        self.blank = [None] * len(plan.steps)
        self.steps = [
            (count + k, _step_fn(plan, step), frees[k]) for k, step in enumerate(plan.steps)
        ]
        self.output = _output_fn(plan)
        self.has_chains = bool(chains(plan, count))
        self.has_blocks = bool(_blocks.blocks(plan, count))


def eligible(plan: Plan) -> bool:
    """Whether ``plan`` runs op by op on every batch whose samples all meet it: no guards
    (no sample goes elsewhere), no late guards or data-dependent sizes (checked between
    steps), no in-place rebinding."""
    return not (
        plan.guards
        or plan.pinned
        or plan.late
        or any(step.defines or step.rebind for step in plan.steps)
    )


def prepared(plan: Plan) -> Prepared | None:
    """The prepared form of an eligible ``plan`` (built at its first warm call), else
    ``None``."""
    found = plan.__dict__.get("_prepared")
    if found is None:
        found = Prepared(plan, len(plan.placeholders)) if eligible(plan) else False
        plan._prepared = found  # type: ignore[attr-defined]
    return found if isinstance(found, Prepared) else None


def run_prepared(prep: Prepared, ctx: Ctx, inputs: list[Any], strict: bool) -> Any:
    """:func:`interpret.run` of the prepared plan (eager, no recorder)."""
    values = inputs + prep.blank
    for index, fn, frees in prep.steps:
        values[index] = fn(ctx, values, strict)
        for i in frees:
            values[i] = None
    return prep.output(ctx, values)


def _arguments(args: tuple[Any, ...]) -> tuple[list[Any], tuple[tuple[int, int], ...], tuple]:
    """``(template, refs, nested)``: a step's arguments with constants in place,
    ``(position, value index)`` of each direct reference, and the positions of
    containers (resolved at each call: they may hold references, and a rule gets a fresh
    list as before)."""
    template = list(args)
    direct = tuple((p, a.index) for p, a in enumerate(args) if type(a) is Ref)
    nested = tuple(
        p for p, a in enumerate(args) if isinstance(a, (list, tuple, dict)) and type(a) is not Ref
    )
    return template, direct, nested


def _step_fn(plan: Plan, step: Step) -> StepFn:
    if step.slot is not None:  # a captured tensor, read afresh at this call
        slot = step.slot
        return lambda ctx, values, strict: ctx.lifted[slot]
    out = step.out
    if step.batched and isinstance(out, Sz):  # (no defines: see eligible)
        return lambda ctx, values, strict: SymB(out)
    if step.batched and isinstance(out, (int, float, bool)):
        return lambda ctx, values, strict: out
    template, direct, nested = _arguments(step.args)

    def arguments(values: list[Any]) -> list[Any]:
        args = template.copy()
        for p, i in direct:
            args[p] = values[i]
        for p in nested:
            args[p] = resolve(template[p], values)
        return args

    def general(ctx: Ctx, values: list[Any], strict: bool) -> Any:
        args = tuple(arguments(values))
        kwargs = {k: resolve(v, values) for k, v in step.kwargs.items()} if step.kwargs else {}
        return run_step(ctx, plan, step, args, kwargs, strict, None)

    if step.getitem or step.random or not step.batched or step.rule is None or plan.pinned:
        return general
    if step.index in _lazy_pairs.lazy_steps(plan):  # a mask built from positions: lazy
        return general
    rule = step.rule

    def by_rule(ctx: Ctx, values: list[Any], strict: bool) -> Any:
        args = arguments(values)
        kwargs = {k: resolve(v, values) for k, v in step.kwargs.items()} if step.kwargs else {}
        if not (_has_batched(args) or (kwargs and _has_batched(kwargs.values()))):
            return run_step(ctx, plan, step, tuple(args), kwargs, strict, None)
        try:
            return rule(ctx, step, *args, **kwargs)
        except Unsupported as error:
            return after_rule(ctx, plan, step, tuple(args), kwargs, strict, None, str(error))

    if rule is not _pointwise.pointwise or step.kwargs or nested:
        return by_rule
    target = step.target
    op = getattr(target, "_op", target)  # an OpOverload's own call adds a Python frame
    dtype = out.dtype

    def by_pointwise(ctx: Ctx, values: list[Any], strict: bool) -> Any:
        args = template.copy()
        for p, i in direct:
            args[p] = values[i]
        first = _pointwise.same_rows(ctx, step, args)
        if first is not None:
            result = op(*[a.values if type(a) is RaggedB else a for a in args])
            if result.dtype != dtype:
                result = result.to(dtype)
            if result.ndim == first.values.ndim and result.shape[0] == first.struct.total:
                return RaggedB(result, first.layout, first.sz, first.struct)
        return by_rule(ctx, values, strict)

    return by_pointwise


def _has_batched(args: Any) -> bool:
    """Whether a batched value is among ``args`` or the lists in them (``run_step``'s
    test, without building the flat list)."""
    for a in args:
        if isinstance(a, BATCHED):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(v, BATCHED) for v in a):
            return True
    return False


def _output_fn(plan: Plan) -> Callable[[Ctx, list[Any]], Any]:
    outputs = plan.outputs
    if len(outputs) == 1 and plan.out_spec.is_leaf():  # one tensor
        (only,) = outputs
        if type(only) is Ref:
            index = only.index
            return lambda ctx, values: to_output(ctx, values[index])
        return lambda ctx, values: to_output(ctx, resolve(only, values))
    spec = plan.out_spec

    def many(ctx: Ctx, values: list[Any]) -> Any:
        return pytree.tree_unflatten([to_output(ctx, resolve(o, values)) for o in outputs], spec)

    return many


__all__ = ["Prepared", "eligible", "prepared", "run_prepared"]
