"""``raggedfn.map`` and ``raggedfn.map_report``: the public entry points."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._errors import describe, fail
from .._ragged import Ragged
from ._fallback import function_loop
from ._interpret import Recorder, check_guards, make_ctx, output_specs, run
from ._report import MapReport
from ._trace import Plan, is_ragged_leaf, leaf_kinds, signature, trace

logger = logging.getLogger("raggedfn.map")

# (function, in_dims, structure, signature) -> {size classes: Plan or why tracing failed}
_CACHE: dict[Any, dict[tuple[int, ...], Plan | str]] = {}
_CACHE_SIZE = 256
# function object -> its function_key at its last eager call (for compiled calls)
_KEY_OF: dict[Any, Any] = {}


def _normalize_in_dims(fn: str, in_dims: Any, count: int) -> tuple[Any, ...]:
    if isinstance(in_dims, int) or in_dims is None:
        dims = (in_dims,) * count
    elif isinstance(in_dims, (tuple, list)):
        dims = tuple(in_dims)
    else:
        raise fail(fn, f"in_dims must be an int, None or a tuple, got {describe(in_dims)}")
    if len(dims) != count:
        raise fail(fn, f"in_dims has {len(dims)} entries but {count} arguments were given")
    for d in dims:
        if d not in (0, None):
            raise fail(fn, f"in_dims entries must be 0 or None, got {d!r}")
    return dims


def _prepare(fn_name: str, args: tuple[Any, ...], in_dims: Any) -> tuple[Any, ...]:
    dims = _normalize_in_dims(fn_name, in_dims, len(args))
    leaves, treespec = pytree.tree_flatten(args, is_leaf=is_ragged_leaf)
    mapped: list[bool] = []
    for a, d in zip(args, dims, strict=True):
        count = len(pytree.tree_leaves(a, is_leaf=is_ragged_leaf))
        mapped.extend([d == 0] * count)
    kinds = leaf_kinds(leaves, mapped)
    batch_sizes: list[Any] = []
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged":
            batch_sizes.append(leaf.batch_size)
        elif kind == "dense":
            if leaf.ndim == 0:
                raise fail(
                    fn_name,
                    "a mapped tensor (in_dims=0) needs a leading batch axis, got a 0-d tensor",
                )
            batch_sizes.append(leaf.shape[0])
    for leaf, m in zip(leaves, mapped, strict=True):
        if m and not isinstance(leaf, (Ragged, torch.Tensor)):
            raise fail(
                fn_name,
                f"a mapped argument (in_dims=0) must be a Ragged or a tensor, got {describe(leaf)}",
            )
    if not batch_sizes:
        raise fail(fn_name, "no argument is mapped: give at least one Ragged or in_dims=0 tensor")
    # no int(): while compiling the batch size stays symbolic (one graph for every B)
    if not torch.compiler.is_compiling() and len({int(b) for b in batch_sizes}) != 1:
        raise fail(
            fn_name,
            f"mapped arguments disagree on the batch size: {sorted({int(b) for b in batch_sizes})}",
        )
    return dims, leaves, treespec, kinds, batch_sizes[0]


def _constant_key(value: Any) -> Any:
    if isinstance(value, (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)):
        return (type(value).__name__, value)
    return ("id", id(value))


def function_key(f: Any) -> Any:
    """What identifies a trace of ``f``: the function itself, or for a plain Python
    function its code plus the objects its closure cells and directly named globals
    hold. A lambda re-created at every step with the same captures hits the cache;
    rebinding a captured tensor (``W = W - lr * g``) is a new key, so the trace never
    keeps a stale tensor. (Tensors reached indirectly, e.g. through a module's
    attributes, are used by reference: in-place updates are seen, rebinding is not;
    pass changing tensors as arguments with ``in_dims=None``.)"""
    if not isinstance(f, types.FunctionType):
        return f
    cells = []
    for cell in f.__closure__ or ():
        try:
            cells.append(_constant_key(cell.cell_contents))
        except ValueError:  # an empty cell
            cells.append(None)
    named = tuple(
        (name, _constant_key(f.__globals__[name]))
        for name in f.__code__.co_names
        if isinstance(f.__globals__.get(name), torch.Tensor)
    )
    defaults = tuple(_constant_key(d) for d in f.__defaults__ or ())
    # text, not objects: dynamo guards on this dict's keys while compiling
    code = f.__code__
    return f"{code.co_filename}:{code.co_firstlineno}:{id(code)}|{cells}|{named}|{defaults}"


def size_classes(leaves: list[Any], kinds: list[str]) -> tuple[int, ...]:
    """For every ragged axis of every mapped input: the first axis whose sizes equal its
    own in every sample (one host sync). Equal axes share one symbol in the trace, so
    ``p + p.transpose(0, 1)`` on square pair states, or pair and token inputs of the
    same length, trace without a size mismatch."""
    columns = [
        leaf.sizes[:, k]
        for leaf, kind in zip(leaves, kinds, strict=True)
        if kind == "ragged"
        for k in range(leaf.num_ragged)
    ]
    if len(columns) < 2:
        return tuple(range(len(columns)))
    table = torch.stack(columns, 1)
    equal = (table[:, :, None] == table[:, None, :]).all(0).tolist()
    return tuple(row.index(True) for row in equal)


def _assert_classes(leaves: list[Any], kinds: list[str], classes: tuple[int, ...]) -> None:
    """While compiling: the cached plan's size classes must hold (checked on device)."""
    columns = [
        leaf.sizes[:, k]
        for leaf, kind in zip(leaves, kinds, strict=True)
        if kind == "ragged"
        for k in range(leaf.num_ragged)
    ]
    for a, c in enumerate(classes):
        if c != a:
            torch._assert_async(
                (columns[a] == columns[c]).all(), "raggedfn.map: ragged sizes differ from the trace"
            )


def _plan_for(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    dims: Any,
    leaves: list[Any],
    treespec: Any,
    kinds: list[str],
) -> Plan | str:
    if torch.compiler.is_compiling():
        # dynamo cannot read code objects and closure cells: use the key the last
        # eager call of this very function object computed
        fkey = _KEY_OF.get(f)
    else:
        fkey = function_key(f)
        if len(_KEY_OF) >= _CACHE_SIZE:
            del _KEY_OF[next(iter(_KEY_OF))]
        _KEY_OF[f] = fkey
    key = (fkey, dims, str(treespec), signature(leaves, kinds))
    variants = _CACHE.get(key)
    if torch.compiler.is_compiling():
        # no host sync here: use the plan traced eagerly for this signature
        if variants is None or len(variants) != 1:
            raise fail(
                "map",
                "inside torch.compile, f must have been traced for this input signature by one "
                "eager call first (found "
                f"{0 if variants is None else len(variants)} traces); call the step once eagerly",
            )
        for classes, plan in variants.items():
            _assert_classes(leaves, kinds, classes)
            return plan
    classes = size_classes(leaves, kinds)
    if variants is None:
        variants = {}
        if len(_CACHE) >= _CACHE_SIZE:  # forget the oldest signature
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = variants
    found = variants.get(classes)
    if found is None:
        try:
            # trace outside any torch.func transform the call runs under
            with torch._C._DisableFuncTorch(), torch.enable_grad():
                found = trace(f, args, dims, leaves, kinds, treespec, classes)
        except Exception as error:  # data-dependent control flow, unsupported graph, ...
            first = str(error).splitlines()[0] if str(error) else ""
            found = f"tracing failed: {type(error).__name__}: {first}"
            logger.info("raggedfn.map: %s; running f per sample", found)
        variants[classes] = found
    return found


def _map(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    in_dims: Any,
    strict: bool,
    report: MapReport | None,
) -> Any:
    dims, leaves, treespec, kinds, batch_size = _prepare("map", args, in_dims)
    plan = _plan_for(f, args, dims, leaves, treespec, kinds)
    if isinstance(plan, str):
        if strict:
            raise fail(
                "map", f"f could not be traced ({plan}); strict=True refuses the per-sample loop"
            )
        if report is not None:
            report.whole_loop = plan
        return function_loop(f, args, dims, batch_size)
    device = next(
        leaf.values.device if isinstance(leaf, Ragged) else leaf.device
        for leaf, k in zip(leaves, kinds, strict=True)
        if k in ("ragged", "dense")
    )
    ctx, inputs = make_ctx(plan, leaves, batch_size, device)
    if report is not None:
        report.trace_seconds = plan.trace_seconds
        report.guards = [text for text, _ in plan.guards]
    if plan.guards and torch.compiler.is_compiling():
        # no fallback is possible inside a graph: a failing guard stops the run on
        # device instead of computing the traced branch for a sample it does not fit
        for text, evaluate in plan.guards:
            ok = evaluate(ctx.env)
            if isinstance(ok, torch.Tensor):
                torch._assert_async(ok.all(), f"raggedfn.map: guard {text} fails")
            elif not ok:
                raise fail("map", f"guard {text} fails")
    elif plan.guards:
        failed = check_guards(plan, ctx)
        if failed:
            reason = "; ".join(f"guard {g} fails for {n} sample(s)" for g, n in failed)
            if strict:
                raise fail(
                    "map",
                    f"the trace of f holds only under {reason}; strict=True refuses the per-sample loop",
                )
            if report is not None:
                report.whole_loop = reason
            logger.info("raggedfn.map: %s; running f per sample", reason)
            return function_loop(f, args, dims, batch_size, output_specs(plan))
    recorder = Recorder() if report is not None else None
    out = run(plan, ctx, inputs, strict, recorder)
    if report is not None and recorder is not None:
        report.batched = dict(recorder.batched)
        report.fallback = dict(recorder.fallback)
        report.unbatched = dict(recorder.unbatched)
    return out


def map(f: Callable[..., Any], *args: Any, in_dims: Any = 0, strict: bool = False) -> Any:
    """Run the per-sample function ``f`` over a batch, as one batched computation.

    Equals ``[f(*(a[i] if d == 0 else a for a, d in zip(args, in_dims))) for i in range(B)]``
    restacked: per-sample outputs whose shape depends on a ragged size become
    ``Ragged``, fixed-shape outputs a dense ``[B, ...]`` tensor, leaf by leaf.
    ``f`` is traced once per input signature (structure, layouts, dtypes,
    dense shapes) and each traced op runs through a batching rule; an op
    without one runs as a per-sample loop for that node (see ``map_report``).

    Args:
        f: a function of per-sample tensors (ordinary torch code).
        *args: ``Ragged`` values and ``[B, ...]`` tensors (mapped) and shared
            values such as parameters (with ``in_dims`` None).
        in_dims: 0 (mapped) or None (shared), one for all or one per argument.
        strict: raise ``RaggedError`` instead of running any per-sample loop.

    Returns:
        The outputs of ``f`` for all samples, with ``f``'s pytree structure.

    Raises:
        RaggedError: ``in_dims`` is not 0/None per argument or has the wrong length; no
            argument is mapped; a mapped argument is not a ``Ragged`` or a tensor with a
            batch axis; mapped arguments disagree on the batch size; with ``strict=True``,
            an op would run as a per-sample loop.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> w = torch.ones(3, 5)
        >>> y = raggedfn.map(lambda t, w: (t @ w).softmax(0).sum(0), x, w, in_dims=(0, None))
        >>> y.shape
        torch.Size([2, 5])
    """
    return _map(f, args, in_dims, strict, None)


def map_report(f: Callable[..., Any], *args: Any, in_dims: Any = 0) -> MapReport:
    """Run ``map(f, *args, in_dims=in_dims)`` and report how each op ran.

    Args:
        f: the per-sample function, as for :func:`map`.
        *args: its arguments, as for :func:`map`.
        in_dims: as for :func:`map`.

    Returns:
        A :class:`MapReport`: ops that ran batched, ops that ran per sample
        (with the reason), guards of the trace, whether the whole function fell
        back to the per-sample loop, and the trace time. ``str(report)`` reads well.

    Raises:
        RaggedError: as :func:`map`.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> report = raggedfn.map_report(lambda t: t.relu().sum(0), x)
        >>> report.fully_batched
        True
    """
    report = MapReport()
    report.output = _map(f, args, in_dims, False, report)
    return report
