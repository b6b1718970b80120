"""``raggedfn.map`` over a nested value inside ``torch.compile``.

A record of ``f`` (``nested/_program.py``) depends only on ``f`` and its state, and on
the layout, dtype, device and dense shape of the arguments: not on the batch's data
or sizes. It is made outside dynamo's view, as one-level map's trace on first use is
(``_compiled.py``): an ``assume_constant_result`` function records the real ``f`` (or
the real function rebuilt from dynamo's view of a function made in the region) on real
argument values, with the fake modes unset. Dynamo then traces the record's replay:
torch code ``f`` ran on its shared arguments and captured tensors, raggedfn ops one
level deeper on the nested batch, and each segment of torch code on per-sample
tensors as a one-level ``map`` (compiled as one-level map is). Before reuse, a record
is chosen as a variant is: dense sizes and constants equal (guarded by dynamo) and
``f``'s compiled dependency check passes (dynamo guards the Python state ``f`` reads
and hands over the tensors it captures). Whatever the per-sample loop would stand in
for eagerly raises ``RaggedError`` under ``fullgraph=True`` (else the call runs
outside the graph).
"""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..._errors import fail
from ..._ragged import Ragged
from ..caching import _cache
from ..caching._lookup import prepare, roots_of
from ..nested._program import Program, build, run
from ..nested._run import NotBatched
from ..tracing._deps import walk
from ..tracing._dynamo_reads import made_inside, one_graph, rebuilt
from ..tracing._trace import LOCK

# shared with one-level compiled map (the same mechanism, one module each)
from ._compiled import (
    EAGER,
    _describe,
    _empty_hooks_unguarded,
    _loose,
    _outside_outer_trace,
    _shapes,
    real_function,
    rebuild_args,
)
from ._compiled import _memo as _once

MAX_PROGRAMS = 8  # per function and argument kinds
MAX_SLOTS = 256  # functions and argument kinds


class _Programs:
    """Records by id, each in a holder's ``__annotations__`` (read by dynamo without
    guards, as ``_cache.REGISTRY``; see ``_compiled._registered``)."""

    def add(self, program: Program) -> str:
        pid = f"p{next(_PIDS)}"  # never reused, even after a clear

        def holder() -> None:
            """Holds one record for compiled code."""

        holder.__annotations__ = {"program": program}
        self.__dict__[pid] = holder
        return pid

    def drop(self, pid: str) -> None:
        if pid in self.__dict__:  # readable a while: a compile in progress may have read it
            _cache.retire(self.__dict__, pid)


_PIDS = itertools.count()
PROGRAMS = _Programs()
_INDEX: dict[Any, list[str]] = {}  # (function key, argument kinds, global state) -> ids


def clear() -> None:
    """Forget every record kept for compiled code (``raggedfn.map_cache_clear``; at exit
    too, before the trace cache's own clearing: a record's check keeps what ``f`` reads)."""
    PROGRAMS.__dict__.clear()
    _INDEX.clear()


atexit.register(clear)  # registered after the trace cache's: runs before it


def _program(pid: str) -> Program:
    found: Program = getattr(PROGRAMS, pid).__annotations__["program"]
    return found


@torch._dynamo.assume_constant_result
def _candidates(key: Any, loose: tuple[Any, ...]) -> tuple[str, ...]:
    """The records of ``f`` for these argument kinds (any sizes)."""
    slot = (key, loose, _cache.global_state())
    return _once("nested candidates", slot, lambda: tuple(_INDEX.get(slot, ())))


@torch._dynamo.assume_constant_result
def _record_now(f: Any, token: Any, structure: Any, dims: Any, layouts: Any, *flat: Any) -> str:
    """Record ``f`` while dynamo runs (``token``: the real function rebuilt from the one
    dynamo made), on the real argument values dynamo hands over."""
    f, key = real_function(f, token, structure, dims, layouts, _shapes(flat))
    return _once("nested record", key, lambda: _record(f, structure, dims, layouts, flat))


def _record(f: Any, structure: Any, dims: Any, layouts: Any, flat: tuple[Any, ...]) -> str:
    args = rebuild_args(structure, layouts, flat)
    dims, leaves, treespec, kinds, _ = prepare("map", args, dims)
    with torch._guards.tracing(None), unset_fake_temporarily(), _outside_outer_trace(), LOCK:
        deps = walk(roots_of(f, leaves, kinds))
        try:
            program = build(f, leaves, kinds, treespec, deps.lifted_ids)
        except NotBatched as error:
            return PROGRAMS.add(Program(failure=str(error)))
    program.deps = deps
    program.fits = tuple(_fit(leaf, kind) for leaf, kind in zip(leaves, kinds, strict=True))
    pid = PROGRAMS.add(program)
    slot = (_cache.function_key(f), _loose(leaves, kinds, treespec, dims), _cache.global_state())
    if slot not in _INDEX and len(_INDEX) >= MAX_SLOTS:  # the oldest function's records
        for old in _INDEX.pop(next(iter(_INDEX))):
            PROGRAMS.drop(old)
    found = _INDEX.setdefault(slot, [])
    found.insert(0, pid)
    while len(found) > MAX_PROGRAMS:
        PROGRAMS.drop(found.pop())
    return pid


def _fit(leaf: Any, kind: str) -> Any:
    """What a later call's leaf must equal for the record to stand for it."""
    if kind == "ragged":
        return ("R", tuple(leaf.values.shape[1:]))
    if kind == "dense":
        return ("D", tuple(leaf.shape[1:]))
    if kind == "shared":
        return ("S", tuple(leaf.shape))
    if type(leaf) in (bool, int, float, complex, str, bytes, type(None)):
        return ("C", (type(leaf), leaf))
    return None  # an object: the dependency check compares it


def _fits(fits: tuple[Any, ...], leaves: list[Any]) -> bool:
    """Dense sizes and constants equal the record's (dynamo guards them)."""
    for want, leaf in zip(fits, leaves, strict=True):
        if want is None:
            continue
        tag, value = want
        if tag == "R" and tuple(leaf.values.shape[1:]) != value:
            return False
        if tag == "D" and tuple(leaf.shape[1:]) != value:
            return False
        if tag == "S" and tuple(leaf.shape) != value:
            return False
        if tag == "C" and (type(leaf) is not value[0] or leaf != value[1]):
            return False
    return True


def _check(program: Program) -> Any:
    deps = program.deps
    return deps.compiled_lean if _empty_hooks_unguarded() else deps.compiled_check


def compiled_nested_map(
    f: Any,
    args: tuple[Any, ...],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    dims: Any,
    randomness: str,
    run_segment: Callable[[Any, tuple[Any, ...], list[Any]], tuple[Any, ...]],
) -> Any:
    """``map(f, *args)`` over nested values inside a compiled region, or ``EAGER``."""
    if randomness != "different":
        return _cannot(f"randomness={randomness!r}")
    roots = [r for r, _ in roots_of(f, leaves, kinds)]
    chosen = None
    lifted: list[Any] = []
    for pid in _candidates(_cache.function_key(f), _loose(leaves, kinds, treespec, dims)):
        program = _program(pid)
        if not _fits(program.fits, leaves):
            continue
        lifted = [None] * len(program.deps.lifted)
        if _check(program)(*roots, lifted):
            chosen = program
            break
    if chosen is None:
        token = None
        if made_inside(f):
            token = rebuilt(f)
            if type(token) is str:
                raise fail(
                    "map",
                    "inside torch.compile, f was made in the compiled region and captures a "
                    f"value that exists only as a graph value while compiling ({token}); "
                    "pass the value to map as an argument (in_dims=None)",
                )
        structure = _describe(args)
        if structure is None:
            raise fail("map", "inside torch.compile, map's arguments hold an unsupported object")
        layouts: list[tuple[str, int] | None] = []
        flat: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, Ragged):
                layouts.append((leaf.layout.code, len(leaf.row_offsets)))
                flat.extend((leaf.values, leaf.offsets, leaf.sizes, *leaf.row_offsets))
            else:
                layouts.append(None)
                flat.append(leaf)
        traced = None if token is not None else f
        chosen = _program(_record_now(traced, token, structure, dims, tuple(layouts), *flat))
        if chosen.failure is not None:
            return _cannot(chosen.failure)
        lifted = [None] * len(chosen.deps.lifted)
        if not _check(chosen)(*roots, lifted):
            raise fail("map", "inside torch.compile, the state f reads did not match its record")
    return run(chosen, leaves, lifted, run_segment)


def _cannot(reason: str) -> Any:
    if not one_graph():
        return EAGER  # graph breaks are allowed: the per-sample loop runs outside the graph
    raise fail(
        "map",
        f"inside torch.compile, f maps over a nested value and cannot run batched "
        f"({reason}); the per-sample loop cannot run inside fullgraph=True",
    )


__all__ = ["compiled_nested_map"]
