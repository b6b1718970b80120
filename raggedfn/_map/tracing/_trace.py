"""Tracing a per-sample function once per input signature, and the plan it becomes.

``make_fx(..., tracing_mode="symbolic", pre_dispatch=True)`` keeps high-level
aten ops. Plain symbolic mode would make every dimension symbolic (parameters
too), so the example inputs are fake tensors built here from one
``ShapeEnv`` in which only the ragged axes get symbols (``DimDynamic.DYNAMIC``)
and every dense axis is static. ``specialize_zero_one=False`` keeps sizes 0
and 1 inside the symbols' ranges, so a branch on them records a guard instead of
being assumed away; every guard is checked against every sample's sizes before
the batched plan runs.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import sympy  # type: ignore[import-untyped]
import torch
import torch._dynamo.config as dynamo_config
import torch.utils._pytree as pytree
from torch import Tensor
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import _config as fx_config
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges

from ..._errors import fail
from ..._ragged import Ragged
from ..base._registry import find_rule, op_name
from ..base._sizes import Evaluator, Sz, Unsupported, compile_expr, equalities, is_unbacked, sz_of
from ..base._steps import LeafKind, Plan, Ref, Step, TSpec
from ..base._values import axes_of, num_ragged_of
from ._guards import LayoutFreeShapeEnv, stride_only
from ._writes import NoRealWrites, alias_chain, check_writes, functional_twin

# Distinct example sizes: relations between symbols that the trace relies on
# become explicit guards, none hold by accident.
HINTS = (5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61)


def is_ragged_leaf(value: Any) -> bool:
    return isinstance(value, Ragged)


def _fake(
    mode: FakeTensorMode, shape: tuple[int, ...], dynamic: list[bool], like: Tensor
) -> Tensor:
    ctx: StatelessSymbolicContext = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DUCK if d else DimDynamic.STATIC for d in dynamic]
    )
    real = torch.empty(shape, dtype=like.dtype, device=like.device)
    return mode.from_tensor(real, symbolic_context=ctx)


def _spec_of(val: Any, replace: dict[Any, Any]) -> Any:
    if isinstance(val, Tensor):
        return TSpec(tuple(sz_of(s, replace) for s in val.shape), val.dtype)
    if isinstance(val, torch.SymInt):
        return sz_of(val, replace)
    if isinstance(val, (torch.SymFloat, torch.SymBool)):
        expr = val.node.expr
        return Sz(str(expr), compile_expr(expr), expr=expr) if expr.free_symbols else val
    if isinstance(val, (tuple, list)):
        return tuple(_spec_of(v, replace) for v in val)
    return val


LOCK = threading.RLock()
_STATE = threading.local()


def tracing() -> bool:
    """Whether this thread is tracing a per-sample function right now."""
    return bool(getattr(_STATE, "active", False))


_MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def _refuse_hooked(module: torch.nn.Module, args: Any) -> None:
    """A module ``f`` calls while being traced: refuse one whose hooks would run once,
    on fake tensors, instead of once per sample (before those hooks run)."""
    if not tracing():  # another thread's module call during this trace
        return
    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    own: set[int] = set()
    if sharded is not None and isinstance(module, sharded):
        from ..entry._fsdp import active, own_hooks

        if not active(module):
            raise fail(
                "map",
                f"f calls a {type(module).__name__} sharded by FSDP2 (fully_shard) whose "
                "parameters map did not gather: map gathers the sharded modules it finds "
                "from f (closures, bound self, defaults, globals, containers, submodules) "
                "once around the call, not those of a map nested inside f; close over "
                "the module or pass it as an argument with in_dims=None",
            )
        own = own_hooks(module)  # made benign for this call: parameters gathered once
    hooks = [
        name.strip("_")
        for name in _MODULE_HOOKS
        if any(key not in own for key in getattr(module, name, None) or ())
    ]
    if hooks:
        # hooks are Python side effects around each call: the per-sample loop runs them
        raise Unsupported(f"f calls a {type(module).__name__} with {', '.join(hooks)}")


def _symbol(env: ShapeEnv, hint: int, name: str) -> Any:
    """A ragged size: a backed symbol with range [0, inf) and no positivity assumption.

    torch's own size symbols are ``positive=True``, so ``n > 0`` or ``n == 0``
    would fold away without a guard and an empty sample would silently take the
    traced branch; here every comparison with any constant is a guard.
    """
    source = ConstantSource(name)
    sym = env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC, positive=None)
    env.var_to_range[sym] = ValueRanges(0, int_oo)
    return env.create_symintnode(sym, hint=hint, source=source)


def _under_tracing(fn: Callable[..., Plan]) -> Callable[..., Plan]:
    """``fn`` run inside :func:`_tracing`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, oblivious: bool = True, **kwargs: Any) -> Plan:
        with _tracing(oblivious):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _tracing(oblivious: bool = True) -> Iterator[None]:
    """Process-wide tracing state for one trace, always restored; ``oblivious=False``
    lets torch's meta functions decide on the example's sizes (each decision a guard)."""
    with LOCK:
        flag = torch.fx._symbolic_trace._is_fx_tracing_flag
        _STATE.active = True
        hook = torch.nn.modules.module.register_module_forward_pre_hook(_refuse_hooked)
        try:
            # inside torch's meta functions, backed sizes are reasoned about like
            # unbacked ones: t[:1] has size Min(1, s) instead of 1 under a guard; the
            # fake tensor cache rebuilds outputs with guards of its own on storage
            # sizes (Ne(numel, 0)): layout bookkeeping, not values
            with (
                fx_config.patch(backed_size_oblivious=oblivious),  # type: ignore[attr-defined]
                dynamo_config.patch(fake_tensor_cache_enabled=False),
            ):
                yield
        finally:
            hook.remove()
            _STATE.active = False
            torch.fx._symbolic_trace._is_fx_tracing_flag = flag


@_under_tracing
def trace(
    fn: Any,
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    classes: tuple[int, ...],
    hints: tuple[int, ...],
    lifted_ids: dict[int, list[int]],
) -> Plan:
    """Trace ``fn`` on symbolic example samples; raises on data-dependent control flow.

    ``classes[a]`` is the first ragged axis (flattened over the inputs) whose sizes
    equal axis ``a``'s in every sample: equal axes share one symbol. ``hints[c]``
    is the example size of class ``c``: the branch the trace takes where ``fn``
    compares sizes (the comparison is recorded as a guard either way).
    ``lifted_ids`` maps ``id`` of each tensor ``fn`` captures to its lifted slots.
    """
    start = time.perf_counter()
    env = LayoutFreeShapeEnv(specialize_zero_one=False, duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    symbols: dict[int, Any] = {}
    axis = 0
    fakes: list[Tensor] = []
    placeholders: list[int] = []
    lk: list[LeafKind] = []
    for i, (leaf, kind) in enumerate(zip(leaves, kinds, strict=True)):
        if kind == "ragged":
            dense = tuple(leaf.values.shape[1:])
            per_axis = []
            for _ in range(num_ragged_of(leaf.layout)):
                c = classes[axis]
                if c not in symbols:
                    symbols[c] = _symbol(env, hints[c], f"ragged{c}")
                per_axis.append(symbols[c])
                axis += 1
            shape = [
                per_axis[a.index] if a.ragged else dense[a.index] for a in axes_of(leaf.layout)
            ]
            with mode:
                fake = torch.empty(shape, dtype=leaf.values.dtype, device=leaf.values.device)
            names = tuple(s.node.expr.name for s in per_axis)
            lk.append(LeafKind("ragged", names, tuple(cast(Sz, sz_of(s)) for s in per_axis)))
        elif kind == "dense":
            fake = _fake(mode, tuple(leaf.shape[1:]), [False] * (leaf.ndim - 1), leaf)
            lk.append(LeafKind("dense"))
        elif kind == "shared":
            fake = _fake(mode, tuple(leaf.shape), [False] * leaf.ndim, leaf)
            lk.append(LeafKind("shared"))
        else:
            lk.append(LeafKind("constant"))
            continue
        fakes.append(fake)
        placeholders.append(i)

    out_holder: list[Any] = []

    def flat_fn(*tensors: Any) -> list[Any]:
        full = list(leaves)
        for i, t in zip(placeholders, tensors, strict=True):
            full[i] = t
        sample_args = pytree.tree_unflatten(full, treespec)
        with NoRealWrites():
            out = fn(*sample_args)
        flat, spec = pytree.tree_flatten(out)
        out_holder.append(spec)
        return flat

    gm = make_fx(flat_fn, tracing_mode="symbolic", pre_dispatch=True)(*fakes)
    checked = [g.expr for g in env.guards]
    for asserts in env.deferred_runtime_asserts.values():
        checked.extend(a.expr for a in asserts)
    replace = equalities(checked)
    steps, outputs, lifted, unknown = _plan_steps(
        gm,
        len(fakes),
        [k.kind for k in lk if k.kind != "constant"],
        lifted_ids,
        replace,
    )
    inputs = [_spec_of(fake, replace) for fake in fakes]
    ours = {name for k in lk for name in k.symbols}
    pinned = any(
        str(sym) in ours and getattr(value, "is_number", False)
        for sym, value in env.replacements.items()
    )
    guards: list[tuple[str, Evaluator]] = []
    guard_exprs: list[Any] = []
    late: list[tuple[str, Evaluator, frozenset[str]]] = []
    found: list[tuple[Any, str, bool]] = []
    for g in env.guards:
        if not stride_only(g):
            loc = getattr(g.sloc, "framework_loc", None)
            filename = str(getattr(loc, "filename", "?")).replace("\\", "/")
            where = f"{filename.rsplit('/', 1)[-1]}:{getattr(loc, 'lineno', '?')} in {getattr(loc, 'name', '?')}"
            found.append((g.expr, where, "/torch/" in filename))
    for asserts in env.deferred_runtime_asserts.values():
        found.extend((a.expr, "runtime assert", False) for a in asserts)
    # a size the ShapeEnv took as fixed is a fact of the traced example, guarded or not:
    # `2*s1*Max(0, s0 - 3) <= 0` refines s1's range to the single value 0 (sympy takes
    # the Max as positive), so the plan had s1 = 0 for every sample of its group
    for sym, value in env.replacements.items():
        if str(sym) in ours:
            found.append((sympy.Eq(sym, value), "a size the trace took as fixed", False))
    seen: set[str] = set()
    internal: set[str] = set()
    for expr, where, torch_own in found:
        text = str(expr)
        if text in seen or text == "True":
            continue
        seen.add(text)
        unbacked = frozenset(str(f) for f in expr.free_symbols if is_unbacked(str(f)))
        if unbacked:
            late.append((f"{text} (from {where})", compile_expr(expr), unbacked))
            continue
        guards.append((f"{text} (from {where})", compile_expr(expr)))
        guard_exprs.append(expr)
        if torch_own:
            internal.add(guards[-1][0])
    try:
        check_writes(gm, steps)
    except Unsupported as error:
        # the trace is complete, only not runnable batched: the loop that runs instead
        # restacks its outputs with the traced structure (the same for every batch)
        error.specs = specs_of(steps, outputs, inputs)  # type: ignore[attr-defined]
        error.pinned = pinned  # type: ignore[attr-defined]
        error.guarded = bool(guards)  # type: ignore[attr-defined]
        error.out_spec = out_holder[-1]  # type: ignore[attr-defined]
        raise
    return Plan(
        steps,
        placeholders,
        lk,
        outputs,
        out_holder[-1],
        guards,
        time.perf_counter() - start,
        lifted,
        unknown,
        pinned=pinned,
        late=late,
        internal=frozenset(internal),
        inputs=inputs,
        guard_exprs=guard_exprs,
        fixed={
            str(sym): int(value)
            for sym, value in env.replacements.items()
            if str(sym) in ours and getattr(value, "is_number", False)
        },
    )


def specs_of(steps: list[Step], outputs: list[Any], inputs: list[Any]) -> list[Any]:
    """The traced spec of every flat output (None for constants); ``inputs``: the specs
    of the placeholders (plan indices ``0 .. len(inputs) - 1``), for outputs that are
    arguments of f returned as they are."""
    by_index = {step.index: step.out for step in steps}
    by_index.update(enumerate(inputs))
    return [by_index.get(o.index) if isinstance(o, Ref) else None for o in outputs]


def _plain(value: Any) -> Any:
    """fx's immutable containers as plain lists/tuples/dicts (torch.compile traces those)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    return value


def _constant(value: Any) -> Any:
    return value


def _plan_steps(
    gm: Any,
    num_inputs: int,
    kinds: list[str],
    lifted_ids: dict[int, list[int]],
    replace: dict[Any, Any],
) -> tuple[list[Step], list[Any], dict[int, int], list[str]]:
    index: dict[Any, int] = {}
    batched: list[bool] = []
    steps: list[Step] = []
    outputs: list[Any] = []
    lifted: dict[int, int] = {}
    unknown: list[str] = []
    known: set[str] = set()
    placeholder = 0

    def to_ref(node: Any) -> Any:
        return Ref(index[node])

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            index[node] = len(batched)
            batched.append(kinds[placeholder] in ("ragged", "dense"))
            placeholder += 1
            continue
        if node.op == "output":
            outputs = list(torch.fx.node.map_arg(node.args[0], to_ref))
            continue
        if node.op == "get_attr":  # a tensor f closes over (e.g. a module's buffer)
            idx = len(batched)
            index[node] = idx
            batched.append(False)
            value = getattr(gm, node.target)
            if isinstance(value, torch.Generator):
                # its state is the trace's, not the call's (a generator made and seeded
                # inside f would repeat, a captured one would continue): run per sample
                raise Unsupported("f draws from an explicit torch.Generator")
            slots = lifted_ids.get(id(value)) if isinstance(value, Tensor) else None
            if slots:  # found by the walk: read afresh at every call
                lifted[idx] = slots[0]
                steps.append(
                    Step(idx, node.name, _constant, (None,), {}, None, False, slot=slots[0])
                )
                continue
            if isinstance(value, Tensor) and not all(
                u.target is torch.ops.aten.lift_fresh_copy.default for u in node.users
            ):
                unknown.append(
                    f"a {value.dtype} tensor of shape {tuple(value.shape)} ({node.target})"
                )
            steps.append(Step(idx, node.name, _constant, (value,), {}, None, False))
            continue
        if node.op != "call_function":
            raise Unsupported(f"graph node kind {node.op}")
        args = _plain(torch.fx.node.map_arg(node.args, to_ref))
        kwargs = _plain(torch.fx.node.map_arg(node.kwargs, to_ref))
        uses = [index[n] for n in node.all_input_nodes]
        random = _is_random(node)
        # a random op draws per sample (randomness="different"), even on shared inputs
        is_batched = any(batched[u] for u in uses) or random
        idx = len(batched)
        index[node] = idx
        batched.append(is_batched)
        val = node.meta.get("val")
        out = _spec_of(val, replace)
        defines = tuple(sorted(_unbacked(val) - known))
        known.update(defines)
        target, rebind = node.target, None
        functional = functional_twin(node) if is_batched else None
        if functional is not None:  # h.relu_() on a fresh h: run relu, rebind h
            chain = alias_chain(node.args[0]) or []
            target, rebind = functional, tuple(index[n] for n in chain)
        steps.append(
            Step(
                idx,
                node.name,
                target,
                tuple(args),
                dict(kwargs),
                out,
                is_batched,
                op_name(target),
                find_rule(target),
                node.target is operator.getitem,
                rebind,
                random=random,
                defines=defines,
                twin=_tensor_twin(target),
            )
        )
    assert placeholder == num_inputs
    return steps, outputs, lifted, unknown


def _tensor_twin(target: Any) -> Any:
    name = getattr(target, "_overloadname", "")
    if not name.startswith("Scalar"):
        return None
    return getattr(target.overloadpacket, name.replace("Scalar", "Tensor", 1), None)


def _is_random(node: Any) -> bool:
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    packet = getattr(target, "overloadpacket", None)
    if packet in (
        torch.ops.aten.dropout,
        torch.ops.aten.feature_dropout,
        torch.ops.aten.alpha_dropout,
    ):
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        return bool(train) and p != 0
    if packet is torch.ops.aten.scaled_dot_product_attention:  # draws only with dropout
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return p != 0
    return True


def _unbacked(val: Any) -> set[str]:
    """Names of the unbacked symbols (data-dependent sizes, and numbers read from the
    data such as ``t.sum().item()``) in a traced value."""
    out: set[str] = set()
    items = val if isinstance(val, (tuple, list)) else (val,)
    for item in items:
        if isinstance(item, Tensor):
            sizes: Any = item.shape
        elif isinstance(item, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            sizes = (item,)  # a bool read from the data is Eq(u, 1), u in [0, 1]
        else:
            continue
        for s in sizes:
            if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                out.update(str(f) for f in s.node.expr.free_symbols if is_unbacked(str(f)))
    return out
