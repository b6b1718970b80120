"""Running a traced plan on a batch: each node through its batching rule or a loop."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..._errors import RaggedPerformanceWarning, fail
from .. import rules  # noqa: F401  (importing the rules registers them)
from ..base._sizes import Sz, Unsupported, product_key
from ..base._steps import Plan, Ref, Step, refs
from ..base._values import BATCHED, Ctx, DenseB, RaggedB, Struct, SymB
from ..rules import _lazy_pairs
from ..tracing._dynamo_reads import static
from . import _blocks
from ._blocks import blocks, run_block
from ._fallback import node_loop, to_output
from ._shared_sizes import bind_shared_sizes, ran_once
from ._tiles import chains, run_chain


class Recorder:
    """What one run did: node name -> op, and which ops fell back (and why)."""

    def __init__(self) -> None:
        self.batched: dict[str, int] = {}
        self.fallback: dict[str, str] = {}
        self.unbatched: dict[str, int] = {}
        self.attention: dict[str, int] = {}  # attention path -> calls (rules note them)


def guard_mask(plan: Plan, ctx: Ctx) -> Tensor | None:
    """``None`` when every sample meets every guard of ``plan`` (or of one of its
    alternative guard sets), else the ``[B]`` mask of the samples that do (one host sync
    per call when the plan has guards)."""
    if not plan.guards or ctx.batch_size == 0:
        return None
    ok = _all_hold(plan.guards, ctx)
    for guards in plan.alternatives:
        if ok is True:
            break
        more = _all_hold(guards, ctx)
        ok = more if ok is False or more is True else ok if more is False else ok | more
    if ok is True:
        return None
    if ok is False:
        return torch.zeros(ctx.batch_size, dtype=torch.bool, device=ctx.device)
    return None if bool(ok.all()) else ok


def _all_hold(guards: list[tuple[str, Any]], ctx: Ctx) -> Any:
    """``True``/``False`` for every sample alike, else the ``[B]`` mask."""
    ok: Any = True
    for _, evaluate in guards:
        value = evaluate(ctx.env)
        if isinstance(value, Tensor):
            value = value.bool()
            ok = value if ok is True else ok & value
        elif not value:
            return False
    return ok


def make_ctx(
    plan: Plan,
    leaves: list[Any],
    batch_size: int,
    device: Any,
    lifted: list[Any] | None = None,
    randomness: str = "different",
    meets: bool = False,
) -> tuple[Ctx, list[Any]]:
    """The context and inputs of ``plan`` on a batch; ``meets``: every sample is known to
    meet the plan's guards (a group of them), so sizes it fixed are those of every
    sample."""
    env: dict[str, Tensor] = {}
    totals: dict[str, Any] = {}
    inputs: list[Any] = []
    ctx = Ctx(batch_size, env, totals, device)
    ctx.lifted = lifted or []
    ctx.randomness = randomness
    structs = ctx.structs
    for i, kind, product, struct_key in _placeholders(plan):
        leaf = leaves[i]
        if kind is None:
            inputs.append(leaf)
        elif struct_key is None:
            inputs.append(DenseB(leaf))
        else:
            sizes = leaf.sizes
            names = kind.symbols
            if len(names) == 1:
                env[names[0]] = sizes.select(1, 0)
            else:
                columns = sizes.unbind(1)
                for k, name in enumerate(names):
                    env[name] = columns[k]
            total = leaf.values.shape[0]
            struct = Struct(sizes, leaf.offsets, total)
            totals[product or ""] = total  # (always a key for a ragged placeholder)
            if struct_key not in structs:
                structs[struct_key] = struct
            fixed = plan.fixed
            if meets and fixed and all(name in fixed for name in names):
                # a plan traced with these sizes fixed (its guards pin every sample of
                # its group to them): the samples are fixed-shape, as the plan sees them
                inputs.append(DenseB(_stacked(leaf, [fixed[n] for n in names], batch_size)))
                continue
            inputs.append(RaggedB(leaf.values, leaf.layout, kind.sz, struct))
    return ctx, inputs


def _stacked(leaf: Any, sizes: list[int], batch_size: int) -> Tensor:
    """The samples of a ``Ragged`` leaf whose ragged sizes are ``sizes`` in every sample,
    as one ``[B, *sample shape]`` tensor (a view of its values)."""
    values = leaf.values.reshape(batch_size, *sizes, *leaf.values.shape[1:])
    perm = leaf.layout.physical_to_logical()
    if list(perm) == sorted(perm):
        return values
    return values.permute(0, *(1 + p for p in perm))


def _placeholders(plan: Plan) -> list[tuple[int, Any, str | None, tuple[str, ...] | None]]:
    """Per placeholder of ``plan``: ``(leaf index, kind (None: unbatched), product key of a
    ragged one's sizes, their struct key (None: dense))``, computed once per plan."""
    found = plan.__dict__.get("_placeholders")
    if found is None:
        found = []
        for i in plan.placeholders:
            kind = plan.leaf_kinds[i]
            if kind.kind == "ragged":
                found.append((i, kind, product_key(kind.sz), tuple(s.key for s in kind.sz)))
            elif kind.kind == "dense":
                found.append((i, kind, None, None))
            else:
                found.append((i, None, None, None))
        if not torch.compiler.is_compiling():  # a side effect dynamo would guard on
            plan._placeholders = found  # type: ignore[attr-defined]
    return found


class LateGuardFailed(Exception):
    """A guard on a data-dependent size (a ``torch._check`` torch's own code made while
    tracing) fails for some sample: the batched plan does not hold for the call."""


def _check_late(plan: Plan, ctx: Ctx, pending: list[int]) -> None:
    for i in list(pending):
        text, evaluate, names = plan.late[i]
        if not names <= ctx.env.keys():
            continue
        pending.remove(i)
        ok = evaluate(ctx.env)
        if isinstance(ok, Tensor) and torch.compiler.is_compiling():
            # no loop inside a graph: the batch stops, as for any other guard there
            torch._assert_async(ok.all(), f"raggedfn.map: guard {text} fails")
        elif not bool(ok.all()) if isinstance(ok, Tensor) else not ok:
            raise LateGuardFailed(f"guard {text} on a data-dependent size fails")


def last_uses(plan: Plan, count: int) -> list[tuple[int, ...]]:
    """For each step of ``plan`` (run with ``count`` inputs): the values no later step
    reads, released once it has run so that a packed intermediate (``sum N_i^2 x 4C``
    floats of a pair state) lives only as long as the loop's would. Outputs and values
    that an in-place op rebinds are kept. Computed once per plan."""
    cached = getattr(plan, "_last_uses", None)
    if cached is not None and cached[0] == count:
        return cached[1]
    keep: set[int] = set()
    for o in plan.outputs:
        refs(o, keep)
    for step in plan.steps:
        keep.update(step.rebind or ())
    last: dict[int, int] = {}
    for k, step in enumerate(plan.steps):
        read: set[int] = set()
        refs(step.args, read)
        refs(step.kwargs, read)
        for index in read:
            last[index] = k
    frees: list[list[int]] = [[] for _ in plan.steps]
    for index, k in last.items():
        if index not in keep:
            frees[k].append(index)
    out = [tuple(f) for f in frees]
    plan._last_uses = (count, out)  # type: ignore[attr-defined]
    return out


def run(
    plan: Plan,
    ctx: Ctx,
    inputs: list[Any],
    strict: bool,
    recorder: Recorder | None,
    quiet: bool = False,
) -> Any:
    """Interpret ``plan`` on a batch; ``quiet``: a node that falls back to its per-sample
    loop does not warn (a group of samples without elements: the loop costs nothing)."""
    values: list[Any] = list(inputs)
    pending = list(range(len(plan.late)))
    ctx.paths = recorder.attention if recorder is not None else None
    compiling = torch.compiler.is_compiling()
    # a graph being compiled owns its buffers; and caching on the plan there would be
    # a side effect dynamo guards on (one more graph)
    frees = last_uses(plan, len(inputs)) if not compiling else [()] * len(plan.steps)

    def resolve(a: Any) -> Any:
        return resolve_in(a, values)

    count = len(inputs)
    tiles = ctx.tiles and not compiling
    row_chains = _lazy_pairs.outside(chains(plan, count), plan) if tiles else {}
    row_blocks = _lazy_pairs.outside(blocks(plan, count), plan) if tiles and _blocks.ENABLED else {}

    def run_plain(k: int) -> None:
        step = plan.steps[k]
        if step.slot is not None:  # a captured tensor, read afresh at this call
            values[count + k] = ctx.lifted[step.slot]
            return
        if compiling:  # the plan's floats: constants of the graph, not graph inputs
            static(step.args)
            static(step.kwargs)
        args = tuple([resolve(a) for a in step.args])
        kwargs = {k: resolve(v) for k, v in step.kwargs.items()} if step.kwargs else {}
        values[count + k] = run_step(ctx, plan, step, args, kwargs, strict, recorder, quiet)

    values.extend([None] * len(plan.steps))
    k = 0
    while k < len(plan.steps):
        chain: Any = row_blocks.get(k)
        tiled: bool | None = None
        if chain is not None:
            tiled = run_block(ctx, plan, chain, values, count, resolve, run_plain)
            kind = "row blocks"
            if tiled is None:  # nothing run (small samples): the flat tiles may take it
                chain = None
        if chain is None and (chain := row_chains.get(k)) is not None:
            tiled = run_chain(ctx, plan, chain, values, count, resolve, run_plain)
            kind = "row tiles"
        if chain is not None:
            if tiled and recorder is not None:
                recorder.batched[kind] = recorder.batched.get(kind, 0) + 1
            for j in range(chain.start, chain.stop):
                if not tiled and j in chain.members:
                    run_plain(j)  # no rebind, no new size: a row-local op
                for index in frees[j]:
                    values[index] = None
            k = chain.stop
            continue
        step = plan.steps[k]
        run_plain(k)
        if step.slot is not None:
            k += 1
            continue
        result = values[count + k]
        for alias in step.rebind or ():
            values[alias] = result
        if step.defines and (not step.batched or ran_once(result)):
            bind_shared_sizes(ctx, step, result)  # an op that ran on shared values only
        for name in step.defines:
            if name not in ctx.env:
                raise fail(
                    "map", f"op {step.op} made a data-dependent size its rule did not define"
                )
        if step.defines and pending:
            _check_late(plan, ctx, pending)
        for index in frees[k]:
            values[index] = None
        k += 1
    if pending:
        raise LateGuardFailed(f"guard {plan.late[pending[0]][0]} could not be checked")
    if not compiling and len(plan.outputs) == 1 and plan.out_spec.is_leaf():  # one tensor
        return to_output(ctx, resolve(plan.outputs[0]))
    flat = [to_output(ctx, resolve(o)) for o in plan.outputs]
    return pytree.tree_unflatten(flat, plan.out_spec)


def resolve_in(a: Any, values: list[Any]) -> Any:
    """A step argument with its references replaced by their values (containers rebuilt,
    named tuples are constants)."""
    if isinstance(a, Ref):
        return values[a.index]
    if isinstance(a, (list, tuple)):
        return type(a)(resolve_in(v, values) for v in a) if not hasattr(a, "_fields") else a
    if isinstance(a, dict):
        return {k: resolve_in(v, values) for k, v in a.items()}
    return a


def run_step(
    ctx: Ctx,
    plan: Plan,
    step: Step,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    strict: bool,
    recorder: Recorder | None,
    quiet: bool = False,
    lazy: bool = True,
) -> Any:
    name = step.op
    out = step.out
    if lazy and _lazy_pairs.active() and step.index in _lazy_pairs.lazy_steps(plan):
        if recorder is not None:  # (a pair state built from positions: see _lazy_pairs)
            recorder.batched[name] = recorder.batched.get(name, 0) + 1
        run = lambda a, kw: run_step(ctx, plan, step, a, kw, strict, None, quiet, False)  # noqa: E731
        return _lazy_pairs.LazyPairB(ctx, plan, step, args, kwargs, run)
    if step.batched and isinstance(out, Sz) and not step.defines:
        return SymB(out)  # a per-sample size: its expression is known, nothing to run
    if step.batched and isinstance(out, (int, float, bool)) and not isinstance(out, Tensor):
        return out  # a size that is the same for every sample
    if step.getitem and isinstance(args[0], (tuple, list)):
        return args[0][args[1]]
    leaves = _leaves(args, kwargs)
    has_batched = any(isinstance(a, BATCHED) for a in leaves)
    if step.random and not has_batched:
        if ctx.randomness == "same":
            return step.target(*args, **kwargs)  # one draw for every sample
        return _random_rule(ctx, step, args, kwargs)
    if step.random and ctx.randomness == "same":
        if any(isinstance(a, (RaggedB, SymB)) for a in leaves):
            raise fail(
                "map",
                f"randomness='same' cannot share one draw of {name} between samples of "
                "different shapes; use randomness='different'",
            )
        # fixed-shape per-sample values: torch.vmap draws once with the sample's shape
        # (the op's own rule would draw per element); else the node's loop, which starts
        # every sample from one generator state
        return after_rule(
            ctx, plan, step, args, kwargs, strict, recorder, "random", quiet, leaves, False
        )
    if not step.batched or not has_batched:
        args, kwargs = _lazy_pairs.forced(args, kwargs)  # (attention on shared operands)
        if recorder is not None and name:
            recorder.unbatched[name] = recorder.unbatched.get(name, 0) + 1
        return step.target(*args, **kwargs)
    reason = "no batching rule"
    if step.rule is not None and not plan.pinned:
        try:  # the common case first, without building the candidates
            result = step.rule(ctx, step, *args, **kwargs)
        except Unsupported as error:
            reason = str(error)
        else:
            if recorder is not None:
                recorder.batched[name] = recorder.batched.get(name, 0) + 1
            return result
    return after_rule(ctx, plan, step, args, kwargs, strict, recorder, reason, quiet, leaves)


def after_rule(
    ctx: Ctx,
    plan: Plan,
    step: Step,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    strict: bool,
    recorder: Recorder | None,
    reason: str,
    quiet: bool = False,
    leaves: list[Any] | None = None,
    own_rule: bool = True,
) -> Any:
    """The rest of :func:`run_step` once a batched step's own rule said ``Unsupported``
    (``reason``), or where it has none: other candidates, else the per-sample loop.
    ``own_rule=False``: the step's own rule is no candidate."""
    name = step.op
    args, kwargs = _lazy_pairs.forced(args, kwargs)  # a loop or torch.vmap needs the values
    leaves = _leaves(args, kwargs)
    candidates = [step.rule] if own_rule and step.rule is not None and plan.pinned else []
    if not any(isinstance(a, (RaggedB, SymB)) for a in leaves):
        candidates.append(_vmap_rule)  # fixed-shape samples: torch.vmap can batch the op
    for found in candidates:
        try:
            result = found(ctx, step, *args, **kwargs)
            if recorder is not None:
                recorder.batched[name] = recorder.batched.get(name, 0) + 1
            return result
        except Unsupported as error:
            reason = str(error)
        except (AttributeError, IndexError, RuntimeError) as error:
            if not plan.pinned:
                raise
            # a plan traced where a guard fixed a ragged size: its fixed sizes and the
            # batched values' ragged axes can disagree in ways a rule does not expect;
            # the per-sample loop of this node is exact
            reason = f"a trace with a ragged size fixed by a guard ({type(error).__name__})"
    if torch.compiler.is_compiling():
        raise fail(
            "map",
            f"op {name} has no batching rule for this use ({reason}), and a per-sample loop "
            "cannot run inside torch.compile(fullgraph=True); run this call eagerly",
        )
    if strict:
        raise fail(
            "map",
            f"op {name} has no batching rule for this use ({reason}); strict=True refuses "
            "the per-sample loop",
        )
    if recorder is not None:
        recorder.fallback[name] = reason
        if step.target is torch.ops.aten.scaled_dot_product_attention.default:
            recorder.attention["per sample"] = recorder.attention.get("per sample", 0) + 1
    if not quiet and (name, reason) not in plan.warned:
        plan.warned.add((name, reason))
        warnings.warn(
            f"raggedfn.map: {name} runs as a per-sample loop ({reason})",
            RaggedPerformanceWarning,
            stacklevel=5,
        )
    return node_loop(ctx, step, args, kwargs)


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
    if not any(dims[i] == 0 for i in tensor_slots):
        raise Unsupported("no batched tensor")

    def call(*tensors: Any) -> Any:
        full = list(data)
        for i, t in zip(tensor_slots, tensors, strict=True):
            full[i] = t
        a, k = pytree.tree_unflatten(full, spec)
        return step.target(*a, **k)

    randomness = ctx.randomness if step.random else "error"
    try:
        with _no_vmap_fallback():
            out = torch.vmap(
                call, in_dims=tuple(dims[i] for i in tensor_slots), randomness=randomness
            )(*(data[i] for i in tensor_slots))
    except Exception as error:  # an op torch.vmap cannot batch: loop instead
        raise Unsupported(f"torch.vmap: {type(error).__name__}") from error
    return pytree.tree_map(DenseB, out) if isinstance(out, (tuple, list)) else DenseB(out)


_FALLBACK_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_vmap_fallback() -> Iterator[None]:
    """``torch.vmap`` without its batched fallback: an op without a vmap rule raises
    (the node's own per-sample loop then runs, with raggedfn's warning) instead of
    looping inside torch and printing torch's warning to stderr. The switch is
    process-wide: set and restored under a lock."""
    if torch.compiler.is_compiling():  # a graph has no such loop to avoid
        yield
        return
    functorch: Any = torch._C._functorch
    with _FALLBACK_LOCK:
        before = functorch._is_vmap_fallback_enabled()
        functorch._set_vmap_fallback_enabled(False)
        try:
            yield
        finally:
            functorch._set_vmap_fallback_enabled(before)


def _random_rule(ctx: Ctx, step: Step, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A random op on shared inputs: one independent draw per sample, as the loop makes."""
    if ctx.batch_size == 0:
        spec = step.out
        return DenseB(torch.empty(0, *spec.shape, dtype=spec.dtype, device=ctx.device))
    dummy = torch.empty(ctx.batch_size, device=ctx.device)

    def call(_: Tensor) -> Any:
        return step.target(*args, **kwargs)

    out = torch.vmap(call, randomness="different")(dummy)
    return pytree.tree_map(DenseB, out) if isinstance(out, (tuple, list)) else DenseB(out)


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


__all__ = ["Recorder", "after_rule", "guard_mask", "make_ctx", "resolve_in", "run", "run_step"]
