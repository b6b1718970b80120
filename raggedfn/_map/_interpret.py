"""Running a traced plan on a batch: each node through its batching rule or a loop."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .._errors import fail
from . import _rules_linalg, _rules_pointwise, _rules_reduce, _rules_shape  # noqa: F401
from ._fallback import node_loop, to_output
from ._sizes import Sz, Unsupported, product_key
from ._trace import Plan, Ref, Step
from ._values import Ctx, DenseB, RaggedB, Struct, SymB, is_batched

logger = logging.getLogger("raggedfn.map")
_logged: set[tuple[str, str]] = set()


class Recorder:
    """What one run did: node name -> op, and which ops fell back (and why)."""

    def __init__(self) -> None:
        self.batched: dict[str, int] = {}
        self.fallback: dict[str, str] = {}
        self.unbatched: dict[str, int] = {}


def check_guards(plan: Plan, ctx: Ctx) -> list[tuple[str, int]]:
    """Guards of the trace that some sample violates: ``(guard, number of samples)``."""
    failed = []
    for text, evaluate in plan.guards:
        ok = evaluate(ctx.env)
        if isinstance(ok, Tensor):
            bad = int((~ok.bool()).sum()) if ok.ndim else int(not bool(ok))
        else:
            bad = 0 if ok else ctx.batch_size
        if bad and ctx.batch_size:
            failed.append((text, bad))
    return failed


def make_ctx(plan: Plan, leaves: list[Any], batch_size: int, device: Any) -> tuple[Ctx, list[Any]]:
    env: dict[str, Tensor] = {}
    totals: dict[str, Any] = {}
    inputs: list[Any] = []
    ctx = Ctx(batch_size, env, totals, device)
    for i in plan.placeholders:
        leaf, kind = leaves[i], plan.leaf_kinds[i]
        if kind.kind == "ragged":
            for k, name in enumerate(kind.symbols):
                env[name] = leaf.sizes[:, k]
            struct = Struct(leaf.sizes, leaf.offsets, leaf.values.shape[0])
            totals[product_key(kind.sz)] = leaf.values.shape[0]
            ctx.structs.setdefault(tuple(s.key for s in kind.sz), struct)
            inputs.append(RaggedB(leaf.values, leaf.layout, kind.sz, struct))
        elif kind.kind == "dense":
            inputs.append(DenseB(leaf))
        else:
            inputs.append(leaf)
    return ctx, inputs


def run(plan: Plan, ctx: Ctx, inputs: list[Any], strict: bool, recorder: Recorder | None) -> Any:
    values: list[Any] = list(inputs)

    def resolve(a: Any) -> Any:
        if isinstance(a, Ref):
            return values[a.index]
        if isinstance(a, (list, tuple)):
            return type(a)(resolve(v) for v in a) if not hasattr(a, "_fields") else a
        if isinstance(a, dict):
            return {k: resolve(v) for k, v in a.items()}
        return a

    for step in plan.steps:
        args = tuple(resolve(a) for a in step.args)
        kwargs = {k: resolve(v) for k, v in step.kwargs.items()}
        result = _run_step(ctx, step, args, kwargs, strict, recorder)
        values.append(result)
        for alias in step.rebind or ():
            values[alias] = result
    flat = [to_output(ctx, resolve(o)) for o in plan.outputs]
    return pytree.tree_unflatten(flat, plan.out_spec)


def _run_step(
    ctx: Ctx,
    step: Step,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    strict: bool,
    recorder: Recorder | None,
) -> Any:
    name = step.op
    out = step.out
    if step.batched and isinstance(out, Sz):
        return SymB(out)  # a per-sample size: its expression is known, nothing to run
    if step.batched and isinstance(out, (int, float, bool)) and not isinstance(out, Tensor):
        return out  # a size that is the same for every sample
    if step.getitem and isinstance(args[0], (tuple, list)):
        return args[0][args[1]]
    if not step.batched or not any(is_batched(a) for a in _leaves(args, kwargs)):
        if recorder is not None and name:
            recorder.unbatched[name] = recorder.unbatched.get(name, 0) + 1
        return step.target(*args, **kwargs)
    reason = "no batching rule"
    candidates = [step.rule] if step.rule is not None else []
    if not any(isinstance(a, (RaggedB, SymB)) for a in _leaves(args, kwargs)):
        candidates.append(_vmap_rule)  # fixed-shape samples: torch.vmap can batch the op
    for found in candidates:
        try:
            result = found(ctx, step, *args, **kwargs)
            if recorder is not None:
                recorder.batched[name] = recorder.batched.get(name, 0) + 1
            return result
        except Unsupported as error:
            reason = str(error)
    if strict:
        raise fail(
            "map",
            f"op {name} has no batching rule for this use ({reason}); strict=True refuses "
            "the per-sample loop",
        )
    if recorder is not None:
        recorder.fallback[name] = reason
    if (name, reason) not in _logged:
        _logged.add((name, reason))
        logger.info("raggedfn.map: %s runs as a per-sample loop (%s)", name, reason)
    return node_loop(ctx, step.target, args, kwargs, out)


def output_specs(plan: Plan) -> list[Any]:
    """The traced spec of every flat output (None for constants and inputs)."""
    by_index = {step.index: step.out for step in plan.steps}
    return [by_index.get(o.index) if isinstance(o, Ref) else None for o in plan.outputs]


def _vmap_rule(ctx: Ctx, step: Step, *args: Any, **kwargs: Any) -> Any:
    """Fixed-shape per-sample values: ``torch.vmap`` runs the op over the batch axis."""
    if ctx.batch_size == 0:
        raise Unsupported("an empty batch")
    flat, spec = pytree.tree_flatten((args, kwargs), is_leaf=lambda v: isinstance(v, DenseB))
    dims = [0 if isinstance(v, DenseB) else None for v in flat]
    data = [v.data if isinstance(v, DenseB) else v for v in flat]
    tensor_slots = [i for i, v in enumerate(data) if isinstance(v, Tensor)]
    if any(dims[i] == 0 for i in range(len(data)) if i not in tensor_slots):
        raise Unsupported("a batched non-tensor")

    def call(*tensors: Any) -> Any:
        full = list(data)
        for i, t in zip(tensor_slots, tensors, strict=True):
            full[i] = t
        a, k = pytree.tree_unflatten(full, spec)
        return step.target(*a, **k)

    try:
        out = torch.vmap(
            call, in_dims=tuple(dims[i] for i in tensor_slots), randomness="different"
        )(*(data[i] for i in tensor_slots))
    except Exception as error:  # an op torch.vmap cannot batch: loop instead
        raise Unsupported(f"torch.vmap: {type(error).__name__}") from error
    return pytree.tree_map(DenseB, out) if isinstance(out, (tuple, list)) else DenseB(out)


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


__all__ = ["Recorder", "check_guards", "make_ctx", "output_specs", "run"]
