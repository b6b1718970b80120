"""A warm eager ``map`` over nested values: the record of ``f`` reused, ``f`` not run.

A cold call records ``f`` on stand-in documents at every call (``nested/_run.py``).
Here, as inside ``torch.compile`` (``_compiled_nested.py``), the record is made once
with every tensor it reads named by where a call has it (``nested/_program.py``: an
argument leaf of ``map``, a tensor ``f`` captures, read afresh through ``f``'s
dependency check, or made by torch code ``f`` ran on those), its steps planned once,
and kept. A later call runs the kept steps on its own values when

- the arguments have the same kinds, dtypes, devices, dense sizes, ``requires_grad``
  flags and constants (the key and ``_fit``);
- grad mode, inference mode and the default dtype are the same, and no autocast,
  ``torch.func`` transform or torch function mode is active (else the cold path);
- ``f``'s dependency check passes (the same check as one-level map's cache: module
  ``training`` flags, numbers, functions and objects ``f`` reads; the tensors it
  captures are read afresh, so a weight changed in place or rebound is the new one).

Where the record cannot name a tensor (a value read from a place the dependency walk
does not follow, a Python number read from a tensor's data, a write into a captured
tensor), the failure is kept under the same check and every call takes the cold path,
which records ``f`` anew each time, as before.
"""

from __future__ import annotations

import atexit
import collections
from collections.abc import Callable
from typing import Any

import torch

from ..._errors import RaggedError
from ..caching import _cache
from ..caching._lookup import roots_of
from ..nested._program import Program, build, run
from ..nested._run import NotBatched
from ..nested._stand_ins import NotRecordable
from ..tracing._deps import walk
from ..tracing._trace import LOCK
from ._compiled_nested import _fit, _fits

MAX_PROGRAMS = 8  # per function, argument kinds and state
MAX_SLOTS = 256

_INDEX: collections.OrderedDict[Any, list[Program]] = collections.OrderedDict()

COLD = object()  # no record can stand for f here: the cold path runs

# counts, for tests: calls that reused a record, calls that made one
STATS = {"hits": 0, "records": 0}


def _slot(f: Any, leaves: list[Any], kinds: list[str], treespec: Any, dims: Any) -> Any:
    """Everything a record is kept under besides its sizes and ``f``'s state; ``None``
    where no record is reused (the cold path records ``f`` anew)."""
    if (
        torch._C._is_any_autocast_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return None
    parts: list[Any] = []
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged":
            v = leaf.values
            parts.append((leaf.layout.code, v.dtype, v.device, v.requires_grad))
        elif kind in ("dense", "shared"):
            parts.append((kind, leaf.dtype, leaf.ndim, leaf.device, leaf.requires_grad))
        else:  # a constant: its value is compared by ``_fits``, an object by the check
            parts.append(type(leaf))
    state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _cache.global_state())
    return (_cache.function_key(f), dims, treespec, tuple(parts), state)


def warm_nested_map(
    f: Callable[..., Any],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    dims: Any,
    run_segment: Callable[[Any, tuple[Any, ...], list[Any]], tuple[Any, ...]],
) -> Any:
    """``map(f, ...)`` over nested values from a kept record; ``COLD`` where the cold
    path must run (no record can stand for ``f`` here). Raises ``NotBatched`` where an
    op of the record refuses the batch (nothing has been returned yet: the loop runs)."""
    slot = _slot(f, leaves, kinds, treespec, dims)
    if slot is None:
        return COLD
    roots = [r for r, _ in roots_of(f, leaves, kinds)]
    found = _INDEX.get(slot)  # (a tree spec hashes what it can of a node's context)
    chosen = None
    lifted: list[Any] = []
    for program in found or ():
        if not _fits(program.fits, leaves):
            continue
        lifted = [None] * len(program.deps.lifted)
        if program.deps.check(*roots, lifted):
            chosen = program
            break
    if chosen is None:
        chosen, lifted = _record(f, leaves, kinds, treespec, slot, roots)
    else:
        STATS["hits"] += 1
    if chosen is None or chosen.failure is not None:
        return COLD
    return run(chosen, leaves, lifted, run_segment, _batch_node)


def _record(
    f: Any, leaves: list[Any], kinds: list[str], treespec: Any, slot: Any, roots: list[Any]
) -> tuple[Program | None, list[Any]]:
    """A new record of ``f``, kept, and the tensors it captures (read before ``f`` runs:
    the record names them; ``f`` may change what it reads, such as a list it appends
    to, and then the next call records it again)."""
    STATS["records"] += 1
    with LOCK:
        deps = walk(roots_of(f, leaves, kinds))
        lifted: list[Any] = [None] * len(deps.lifted)
        if not deps.check(*roots, lifted):  # (an object whose reads disagree)
            return None, lifted
        try:
            program = build(f, leaves, kinds, treespec, deps.lifted_ids)
        except NotBatched as error:
            program = Program(failure=str(error))
        program.deps = deps
        program.fits = tuple(_fit(leaf, kind) for leaf, kind in zip(leaves, kinds, strict=True))
        if slot not in _INDEX and len(_INDEX) >= MAX_SLOTS:
            _INDEX.popitem(last=False)
        found = _INDEX.setdefault(slot, [])
        _INDEX.move_to_end(slot)
        found.insert(0, program)
        del found[MAX_PROGRAMS:]
    return program, lifted


def _batch_node(node: Any, args: Any, kwargs: Any) -> Any:
    """A raggedfn op one level deeper on the batch; one that refuses it: the loop's turn
    (as on the cold path)."""
    try:
        return node.fn(*args, **kwargs)
    except RaggedError as error:
        raise NotBatched(
            str(NotRecordable(f"raggedfn.{node.fn.__name__} on the batch: {error}"))
        ) from None


def clear() -> None:
    """Forget every kept record (``raggedfn.map_cache_clear``; at exit too, before the
    trace cache's own clearing and collection: a record's check keeps what ``f`` reads,
    see ``caching/_cache._clear_at_exit``)."""
    _INDEX.clear()


atexit.register(clear)  # registered after the trace cache's: runs before it


__all__ = ["COLD", "STATS", "clear", "warm_nested_map"]
