"""The trace cache of ``raggedfn.map``: keyed by what ``f`` is, guarded by what it reads.

A cache entry belongs to ``f``'s code (a function re-created at every call, such
as a lambda inside a loss, finds the same entry; a module or callable object
finds the entry of its class). Inside an entry, *variants* hold traces for one
input signature and one state of everything ``f`` reads besides its arguments
(:mod:`._deps`): a variant is reused only when its compiled check passes, which
also re-reads the tensors ``f`` captures. A variant holds up to
:data:`MAX_PLANS` plans, traced on different example sizes: samples whose
sizes fail every plan's guards get a new plan (or the per-sample loop).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import gc
import itertools
import types
from typing import Any, NamedTuple

import torch

from ..base._steps import Plan
from ..tracing._deps import Deps

MAX_FUNCTIONS = 256
MAX_VARIANTS = 16
MAX_PLANS = 4


_IDS = itertools.count()


@dataclasses.dataclass
class Variant:
    static: tuple[Any, ...]  # in_dims, structure, signature, size classes, global state
    deps: Deps
    vid: str = dataclasses.field(default_factory=lambda: f"v{next(_IDS)}")
    plans: list[Plan] = dataclasses.field(default_factory=list)
    failure: str | None = None  # why tracing failed: the whole call runs per sample
    # per flat output, its ragged per-sample axes (f's structure, whatever the batch)
    structure: list[tuple[int, ...]] | None = None
    exhausted: str | None = None  # why no further plan is traced (a retrace failed)
    no_empty_plan: bool = False  # a retrace on an empty sample failed: those run per sample
    # (output specs, pytree spec) of a complete trace that cannot run batched: the
    # result of an empty batch (no sample runs, so no side effect happens either)
    empty: tuple[list[Any], Any] | None = None
    warned: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Entry:
    variants: list[Variant] = dataclasses.field(default_factory=list)
    traces: int = 0
    hits: int = 0
    evictions: int = 0
    warm: list[Any] = dataclasses.field(default_factory=list)  # recent hits (see _warm)


class CacheInfo(NamedTuple):
    """What ``raggedfn.map`` has cached for one function (see :func:`map_cache_info`).

    Attributes:
        traces: calls that found no cached variant and traced the function (each
            failed trace counts; the probe traces of a first trace count with it; a
            retrace for samples a cached plan's guards refuse does not count: it
            becomes a plan, counted in ``plans``, or widens the plan it matches).
        hits: calls that found a cached variant.
        variants: cached (input signature, captured state) combinations.
        plans: traces held across those variants.
        evictions: variants dropped because the entry was full.

    Examples:
        >>> import torch, raggedfn
        >>> def per_sample(t):
        ...     return t.sum(0)
        >>> raggedfn.map_cache_info(per_sample)
        CacheInfo(traces=0, hits=0, variants=0, plans=0, evictions=0)
    """

    traces: int
    hits: int
    variants: int
    plans: int
    evictions: int


CACHE: collections.OrderedDict[Any, Entry] = collections.OrderedDict()


class _Variants:
    """Variant id -> variant as attributes, for compiled code: dynamo guards each
    attribute it reads and reads it live, so a variant traced while compiling is
    found, and adding or dropping others never recompiles a graph. Each attribute is
    a holder function with the variant in its ``__annotations__`` (see
    ``_compiled._registered``: dynamo reads what is below it without guards)."""

    def get(self, vid: str) -> Variant | None:
        holder = self.__dict__.get(vid)
        return None if holder is None else holder.__annotations__["variant"]

    def pop(self, vid: str, default: Any = None) -> Any:
        """Drop ``vid`` from lookups; its holder stays readable a while (see
        :data:`RETIRED`)."""
        holder = self.__dict__.get(vid)
        if holder is None:
            return default
        retire(self.__dict__, vid)
        return holder.__annotations__["variant"]

    def clear(self) -> None:
        self.__dict__.clear()

    def __setitem__(self, vid: str, variant: Variant) -> None:
        def holder() -> None:
            """Holds one variant for compiled code."""

        holder.__annotations__ = {"variant": variant}
        self.__dict__[vid] = holder

    def setdefault(self, vid: str, variant: Variant) -> Variant:
        if vid not in self.__dict__:
            self[vid] = variant
        return self.get(vid)  # type: ignore[return-value]


REGISTRY = _Variants()

# Holders dropped from a registry (evicted) stay readable for the next RETIRED drops: a
# compile in progress that read one (dynamo reads holders live and guards each one when
# it builds the graph's guards) would otherwise fail with an AttributeError inside dynamo
# when a trace made during the same compile evicted it. An evicted variant is still a
# valid plan; it is only no longer found by lookups.
RETIRED = 64
_retired: collections.deque[tuple[dict[str, Any], str]] = collections.deque()


def retire(holders: dict[str, Any], key: str) -> None:
    """Remove ``holders[key]`` after ``RETIRED`` later retirements (now if the registry
    is cleared first, which drops every holder at once)."""
    _retired.append((holders, key))
    while len(_retired) > RETIRED:
        old, old_key = _retired.popleft()
        old.pop(old_key, None)


def function_key(f: Any) -> Any:
    """What a cache entry belongs to: the code of a function, the class of anything else."""
    if isinstance(f, types.FunctionType):
        return f.__code__
    if isinstance(f, types.MethodType):
        return ("method", function_key(f.__func__))
    if isinstance(f, functools.partial):
        return ("partial", function_key(f.func))
    return ("type", type(f))


def global_state() -> tuple[Any, ...]:
    """Process state a trace bakes in: the default dtype (factories) and autocast."""
    return (
        torch.get_default_dtype(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
    )


def entry_of(f: Any, create: bool) -> Entry | None:
    return entry_of_key(function_key(f), create)


def entry_of_key(key: Any, create: bool) -> Entry | None:
    entry = CACHE.get(key)
    if entry is None:
        if not create:
            return None
        if len(CACHE) >= MAX_FUNCTIONS:
            for variant in CACHE.popitem(last=False)[1].variants:
                REGISTRY.pop(variant.vid, None)
        entry = CACHE[key] = Entry()
    else:
        CACHE.move_to_end(key)
    return entry


def find(
    entry: Entry, static: tuple[Any, ...], roots: list[Any]
) -> tuple[Variant, list[Any]] | None:
    """The first variant whose signature and captured state match, with the tensors
    ``f`` captures read afresh."""
    for variant in entry.variants:
        if variant.static != static:
            continue
        lifted: list[Any] = [None] * len(variant.deps.lifted)
        if variant.deps.check(*roots, lifted):
            return variant, lifted
    return None


def add(entry: Entry, variant: Variant) -> None:
    entry.variants.insert(0, variant)
    REGISTRY[variant.vid] = variant
    while len(entry.variants) > MAX_VARIANTS:
        dropped = entry.variants.pop()
        REGISTRY.pop(dropped.vid, None)
        entry.evictions += 1
        entry.warm = [m for m in entry.warm if m.variant is not dropped]


def info(f: Any) -> CacheInfo:
    entry = entry_of(f, create=False)
    if entry is None:
        return CacheInfo(0, 0, 0, 0, 0)
    plans = sum(len(v.plans) for v in entry.variants)
    return CacheInfo(entry.traces, entry.hits, len(entry.variants), plans, entry.evictions)


def clear() -> None:
    """Forget every trace (:func:`raggedfn.map_cache_clear`; tests and benchmarks that
    measure tracing use this)."""
    CACHE.clear()
    REGISTRY.clear()


def _clear_at_exit() -> None:
    """Free what the traces hold while the interpreter is whole: their checks keep what
    ``f`` reads (modules, and through FSDP2's or DDP's state a process group) alive, and
    a gloo group whose last reference goes during interpreter finalization aborts the
    process ('terminate called without an active exception'). The modules' reference
    cycles are collected here too, for the same reason."""
    clear()
    gc.collect()


atexit.register(_clear_at_exit)


__all__ = [
    "CacheInfo",
    "Entry",
    "Variant",
    "add",
    "clear",
    "entry_of",
    "entry_of_key",
    "find",
    "function_key",
    "info",
]
