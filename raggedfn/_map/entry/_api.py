"""``raggedfn.map``, ``raggedfn.map_report``, ``raggedfn.map_cache_info`` and
``raggedfn.map_cache_clear``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from ..._errors import RaggedPerformanceWarning, fail
from ..base._report import MapReport
from ..base._sizes import SampleRaises, Unsupported
from ..caching import _cache, _warm
from ..caching._cache import CacheInfo
from ..caching._groups import (
    check_randomness,
    device_of,
    guard_texts,
    refuse_unknown_empty,
    restructure,
    run_split,
    whole_loop,
)
from ..caching._lookup import lookup, prepare
from ..nested._run import NotBatched, nested_map
from ..nested._stand_ins import refuse_stand_ins
from ..running._chunked import run_chunked
from ..running._chunks import check_chunk_elements
from ..running._fallback import function_loop
from ..running._interpret import LateGuardFailed, Recorder, guard_mask, make_ctx
from ..running._split import empty_result
from ..tracing._trace import tracing
from . import _compiled_nested, _eager_nested
from ._compiled import EAGER, compiled_map
from ._compiled_nested import compiled_nested_map
from ._eager_nested import COLD, warm_nested_map
from ._fsdp import around

_RANDOMNESS = ("different", "same", "error")


def _map(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    in_dims: Any,
    strict: bool,
    randomness: str,
    report: MapReport | None,
    chunk_elements: int | None = None,
) -> Any:
    chunk_elements = check_chunk_elements(chunk_elements)
    if randomness not in _RANDOMNESS:
        raise fail("map", f"randomness must be one of {_RANDOMNESS}, got {randomness!r}")
    refuse_stand_ins(args)
    if tracing():
        # raggedfn.map inside a function being traced for raggedfn.map: the outer
        # trace fails and the outer call runs per sample, where this call is ordinary
        raise Unsupported("map nested inside a mapped function is not batched")
    dims, leaves, treespec, kinds, batch_size = prepare("map", args, in_dims)
    if any(k == "ragged" and leaf.row_offsets for leaf, k in zip(leaves, kinds, strict=True)):
        # a nested value's samples are one-level Ragged values: f runs on each of them
        # (its sizes count elements per level, not extents; no trace of them yet)
        reason = "f maps over a nested value (its samples are Ragged values)"

        def run_map(g: Any, g_args: tuple[Any, ...], g_dims: Any, part: MapReport | None) -> Any:
            if part is None:  # (a report reads the cold path)
                out = _warm.call(g, g_args, g_dims, strict, randomness, chunk_elements)
                if out is not _warm.MISS:
                    return out
            return _map(g, g_args, g_dims, strict, randomness, part, chunk_elements)

        def warm_segment(g: Any, inputs: tuple[Any, ...], shared: list[Any]) -> Any:
            dims = (0,) * len(inputs) + (None,) * len(shared)
            return run_map(g, (*inputs, *shared), dims, None)

        if torch.compiler.is_compiling():

            def run_segment(g: Any, inputs: tuple[Any, ...], shared: list[Any]) -> Any:
                dims = (0,) * len(inputs) + (None,) * len(shared)
                return _map(g, (*inputs, *shared), dims, strict, randomness, None, chunk_elements)

            out = compiled_nested_map(
                f, args, leaves, kinds, treespec, dims, randomness, run_segment
            )
            if out is EAGER:  # a graph break (not under fullgraph=True)
                return _outside_the_graph(
                    f, args, in_dims, strict, randomness, report, chunk_elements
                )
            return out

        try:
            if report is None and randomness == "different":  # a kept record of f
                out = warm_nested_map(f, leaves, kinds, treespec, dims, warm_segment)
                if out is not COLD:
                    return out
            return nested_map(f, leaves, kinds, treespec, run_map, randomness, report)
        except NotBatched as error:
            reason = f"{reason}, not batched: {error}"
        return whole_loop(f, args, dims, batch_size, None, reason, strict, randomness, report, None)
    if torch.compiler.is_compiling():
        out = compiled_map(f, args, leaves, kinds, treespec, dims, batch_size, randomness)
        if out is EAGER:  # a graph break (not under fullgraph=True)
            return _outside_the_graph(f, args, in_dims, strict, randomness, report, chunk_elements)
        return out
    variant, lifted, entry, classes = lookup(f, leaves, kinds, treespec, dims)
    _warm.remember(entry, args, in_dims, dims, kinds, classes, variant)
    if report is not None:
        report.traces = entry.traces
        report.structure = variant.structure
    if variant.failure is not None and batch_size == 0 and variant.empty is not None:
        empty = empty_result(*variant.empty, variant.structure, device_of(leaves, kinds))
        if empty is not None:
            return empty
    if variant.failure is not None:
        if strict:
            raise fail(
                "map",
                f"f could not be traced ({variant.failure}); strict=True refuses the "
                "per-sample loop",
            )
        return whole_loop(
            f,
            args,
            dims,
            batch_size,
            variant,
            variant.failure,
            strict,
            randomness,
            report,
            variant.structure,
        )
    check_randomness(variant.plans, randomness)
    if batch_size == 0:
        refuse_unknown_empty(variant)
    device = device_of(leaves, kinds)
    plan = variant.plans[0]
    if report is not None:
        report.trace_seconds = sum(p.trace_seconds for p in variant.plans)
        report.guards = guard_texts(variant.plans)
    ctx, inputs = make_ctx(plan, leaves, batch_size, device, lifted, randomness)
    recorder = Recorder() if report is not None else None
    ok = guard_mask(plan, ctx)
    try:
        if ok is None:  # every sample meets the guards: the common case, no split
            out = run_chunked(
                plan,
                ctx,
                inputs,
                leaves,
                kinds,
                lifted,
                chunk_elements,
                strict,
                randomness,
                recorder,
            )
            if plan.pinned or plan.guards:
                # fixed sizes of a trace under guards become ragged where f's are
                out = restructure(out, variant, batch_size, device)
        else:
            out = run_split(
                f,
                args,
                dims,
                leaves,
                kinds,
                treespec,
                batch_size,
                device,
                variant,
                lifted,
                classes,
                ok,
                strict,
                randomness,
                recorder,
                report,
            )
    except LateGuardFailed as error:
        late: str | None = str(error)
    else:
        late = None
    if late is not None:
        # torch checked a data-dependent size while tracing (a narrow of a nonzero
        # count) and some sample breaks it: the loop gives that sample torch's answer
        return whole_loop(
            f, args, dims, batch_size, variant, late, strict, randomness, report, variant.structure
        )
    if report is not None and recorder is not None:
        report.batched = dict(recorder.batched)
        report.fallback = dict(recorder.fallback)
        report.unbatched = dict(recorder.unbatched)
        report.attention = dict(recorder.attention)
    return out


def map(
    f: Callable[..., Any],
    *args: Any,
    in_dims: Any = 0,
    strict: bool = False,
    randomness: str = "different",
    chunk_elements: int | None = None,
) -> Any:
    """Run the per-sample function ``f`` over a batch, as one batched computation.

    Equals ``[f(*(a[i] if d == 0 else a for a, d in zip(args, in_dims))) for i in range(B)]``
    restacked: per-sample outputs whose shape depends on a ragged size become
    ``Ragged``, fixed-shape outputs a dense ``[B, ...]`` tensor, per-sample
    numbers a ``[B]`` tensor, leaf by leaf. ``f`` is traced once per input
    signature and state of what it reads besides its arguments (module
    ``training`` flags, Python numbers in closures and globals, ...); tensors it
    captures are read afresh at every call. Each traced op runs through a
    batching rule; an op without one runs as a per-sample loop for that node
    (a :class:`RaggedPerformanceWarning` says so; see ``map_report``).

    Args:
        f: a function of per-sample tensors (ordinary torch code). Over a nested
            value each sample is a one-level ``Ragged`` (a document's sentences of
            tokens), on which ``f`` may use raggedfn ops, and torch on their dense
            results (docs/map.md, "Nested values").
        *args: ``Ragged`` values and ``[B, ...]`` tensors (mapped) and shared
            values such as parameters (with ``in_dims`` None).
        in_dims: 0 (mapped) or None (shared), one for all or one per argument.
        strict: raise ``RaggedError`` instead of running any per-sample loop (samples
            without elements excepted: they cost nothing, and a guard of torch's own
            code may send them off the batched plan).
        randomness: as in ``torch.func.vmap``: ``"different"`` (random ops draw
            independently for every sample, like the loop), ``"same"`` (one draw
            shared by all samples; refused for ragged shapes) or ``"error"``.
        chunk_elements: run the batch in groups of consecutive samples whose largest
            intermediate holds at most this many elements, joined in sample order,
            and run chains of row-local ops (``linear``, activations, arithmetic,
            sums over fixed-size axes) on cache-sized tiles of the packed rows, and
            pair-state chains (from ``s[:, None] + s[None]`` through row softmaxes
            to ``a @ s``) per sample on blocks of rows, where their weights are
            small; ``None`` for the default budget (16M elements), 0 for the whole
            batch op by op (no groups, no tiles). Results and gradients are the
            same either way. Not used inside ``torch.compile``.

    Returns:
        The outputs of ``f`` for all samples, with ``f``'s pytree structure.

    Raises:
        RaggedError: ``in_dims`` is not 0/None per argument or has the wrong length; no
            argument is mapped; a mapped argument is not a ``Ragged`` or a tensor with a
            batch axis; mapped arguments disagree on the batch size; ``randomness`` is
            not one of the three; ``randomness="error"`` and ``f`` draws random numbers;
            with ``strict=True``, anything would run as a per-sample loop.
        Exception: whatever ``f`` raises for a sample, as the per-sample loop raises
            it (the same object, so ``except KeyError`` catches it), with a note
            ``raggedfn.map: raised by f for sample i``; also where a batching rule finds
            a sample torch refuses (an index past its end, ``amax`` of an empty axis).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> w = torch.ones(3, 5)
        >>> y = raggedfn.map(lambda t, w: (t @ w).softmax(0).sum(0), x, w, in_dims=(0, None))
        >>> y.shape
        torch.Size([2, 5])
    """
    return around(f, args, lambda a: _call(f, a, in_dims, strict, randomness, chunk_elements))


def _call(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    in_dims: Any,
    strict: bool,
    randomness: str,
    chunk_elements: int | None,
) -> Any:
    try:
        out = _warm.call(f, args, in_dims, strict, randomness, chunk_elements)
        if out is _warm.MISS:
            return _map(f, args, in_dims, strict, randomness, None, chunk_elements)
    except SampleRaises as error:
        _raise_as_the_loop(f, args, in_dims, randomness, error)
    return out


def map_report(
    f: Callable[..., Any],
    *args: Any,
    in_dims: Any = 0,
    randomness: str = "different",
    chunk_elements: int | None = None,
) -> MapReport:
    """Run ``map(f, *args, in_dims=in_dims)`` and report how each op ran.

    Args:
        f: the per-sample function, as for :func:`map`.
        *args: its arguments, as for :func:`map`.
        in_dims: as for :func:`map`.
        randomness: as for :func:`map`.
        chunk_elements: as for :func:`map`.

    Returns:
        A :class:`MapReport`: ops that ran batched, ops that ran per sample
        (with the reason), guards of the trace, whether the whole function fell
        back to the per-sample loop, and the trace time. ``str(report)`` reads well.
        No :class:`RaggedPerformanceWarning` is emitted: the report says it all.

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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedPerformanceWarning)

        def reported(a: tuple[Any, ...]) -> Any:
            try:
                return _map(f, a, in_dims, False, randomness, report, chunk_elements)
            except SampleRaises as error:
                _raise_as_the_loop(f, a, in_dims, randomness, error)

        report.output = around(f, args, reported)
    return report


@torch._dynamo.disable
def _outside_the_graph(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    in_dims: Any,
    strict: bool,
    randomness: str,
    report: MapReport | None,
    chunk_elements: int | None,
) -> Any:
    """The call run eagerly: dynamo breaks the graph around it."""
    try:
        return _map(f, args, in_dims, strict, randomness, report, chunk_elements)
    except SampleRaises as error:
        _raise_as_the_loop(f, args, in_dims, randomness, error)


def _raise_as_the_loop(
    f: Callable[..., Any], args: tuple[Any, ...], in_dims: Any, randomness: str, found: Exception
) -> NoReturn:
    """A batching rule found a sample for which ``f`` raises: run ``f`` per sample, which
    raises ``f``'s own exception for the first such sample, as the loop does (with a note
    naming it). The call fails either way; only the loop knows the exact exception."""
    dims, _, _, _, batch_size = prepare("map", args, in_dims)
    function_loop(f, args, dims, batch_size, None, randomness)
    raise fail("map", str(found).removeprefix("map: ")) from None  # the loop did not raise


def map_cache_info(f: Callable[..., Any]) -> CacheInfo:
    """How many times ``raggedfn.map`` traced ``f`` (or its code), and what it keeps.

    Functions re-created at every call (a lambda inside a loss) share the entry
    of their code; modules and callable objects share the entry of their class.

    Args:
        f: a function (or module, or callable object) given to :func:`map`.

    Returns:
        A :class:`CacheInfo`: ``traces`` (calls that traced the code anew; a retrace
        for samples a cached plan's guards refuse becomes or widens a plan instead),
        ``hits``, ``variants``, ``plans`` and ``evictions``; all zero for a function
        never mapped.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> def f(t):
        ...     return t.sum(0)
        >>> for _ in range(3):
        ...     _ = raggedfn.map(f, x)
        >>> raggedfn.map_cache_info(f).traces
        1
    """
    return _cache.info(f)


def map_cache_clear() -> None:
    """Forget every trace ``raggedfn.map`` keeps, as ``functools.lru_cache``'s
    ``cache_clear`` does.

    A trace keeps what ``f`` reads to check it later (the modules it calls, the
    objects it captures), so a model mapped once stays alive until its traces are
    evicted or cleared. Clear them to free such a model without ending the process,
    or before ``torch.distributed.destroy_process_group()`` where ``f`` calls modules
    wrapped by FSDP2 or DDP (their state holds the process group). At exit the traces
    are cleared by themselves. The next call of each function traces it again.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> def f(t):
        ...     return t.sum(0)
        >>> _ = raggedfn.map(f, x)
        >>> raggedfn.map_cache_clear()
        >>> raggedfn.map_cache_info(f).traces
        0
    """
    _cache.clear()
    _eager_nested.clear()
    _compiled_nested.clear()


__all__ = ["map", "map_cache_clear", "map_cache_info", "map_report"]
