"""The warm call of ``raggedfn.map``: recent hits of a function, found again cheaply.

A cache lookup (:func:`_lookup.lookup`) builds the call's whole key (normalized
``in_dims``, tree spec, input signature, size classes, process state) and compares it
with each variant's. For the common warm call (the same function, arguments of the
same kinds, dtypes, fixed sizes, layouts and devices as a recent hit) :func:`call`
compares a shorter key with those remembered on the cache entry instead, and runs
the remembered plan (prepared, see :mod:`._prepared`). What it never skips: the
dependency check of what ``f`` reads (``Deps.check``: rebound parameters are read
afresh, changed module state or Python numbers send the call to the general path),
the size classes of inputs with two or more ragged axes (they depend on the data),
the batch sizes' agreement and the chunk budget. Arguments may be ``Ragged`` values
(mapped), tensors (mapped or shared) and shared containers of tensors (a dict of
parameters: its tree spec is part of the key). Anything else (other kinds of
arguments, autocast, another default dtype, a nested value, a report, tracing,
compiling) goes to the general path, which raises the errors and does the rest.

Never runs while compiling: the first thing it asks is whether dynamo is tracing
(reading the cache entry there would be a side effect dynamo guards on).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.nn import Parameter

from ..._ragged import Ragged
from ..base._steps import Plan
from ..running import _blocks
from ..running._chunked import run_chunked
from ..running._chunks import DEFAULT_CHUNK_ELEMENTS, within_budget
from ..running._interpret import make_ctx, run
from ..tracing._signature import size_classes
from ..tracing._trace import is_ragged_leaf, tracing
from . import _cache
from ._prepared import eligible, prepared, run_prepared

MISS = object()
_TREE = object()  # the tag of a container's key


class Memo:
    """What a warm call compares, and what it runs: the argument count, ``in_dims`` as
    given and normalized, one key per argument, the size classes (``None``: fewer than
    two ragged axes, nothing to compare), the default dtype, the variant and its plan."""

    __slots__ = (
        "classes",
        "count",
        "dims",
        "dtype",
        "flat",
        "in_dims",
        "keys",
        "kinds",
        "plan",
        "variant",
    )

    def __init__(
        self,
        classes: tuple[int, ...] | None,
        count: int,
        dims: tuple[Any, ...],
        dtype: torch.dtype,
        in_dims: Any,
        keys: tuple[Any, ...],
        kinds: list[str],
        plan: Plan,
        variant: _cache.Variant,
        flat: bool,
    ) -> None:
        self.flat = flat  # every argument one leaf (no container)
        self.classes = classes
        self.count = count
        self.dims = dims
        self.dtype = dtype
        self.in_dims = in_dims
        self.keys = keys
        self.kinds = kinds
        self.plan = plan
        self.variant = variant


def _key(a: Any, d: Any) -> Any:
    """One argument's part of the warm key, ``None`` for one the warm call does not take
    (the general path's signature holds the same facts: see ``_signature.signature``)."""
    t = type(a)
    if t is Ragged:
        v = a.values
        if d is None or type(v) is not Tensor:
            return None
        # (a nested value's layout code names its nested axes: never a flat one's key,
        # and the general path, which loops over nested values, remembers none)
        return ("R", a.layout.code, v.dtype, v.shape[1:], v.device)
    if t is Tensor or t is Parameter:
        if d is None:
            return ("S", a.dtype, a.shape, a.device)
        if a.ndim == 0:
            return None
        return ("D", a.dtype, a.shape[1:], a.device)
    if d is None and (t is dict or t is list or t is tuple):
        return _container_key(a)[0]
    return None


def _container_key(a: Any) -> tuple[Any, list[Any]]:
    """``(key, leaves)`` of a shared container (a dict of parameters): its tree spec and
    each leaf's dtype, shape and device, where every leaf is a tensor (``None`` key
    otherwise: a number or object among them is a constant of the trace, which the
    general path compares by value or walks as a root of the dependency check)."""
    leaves, spec = pytree.tree_flatten(a, is_leaf=is_ragged_leaf)
    parts = []
    for leaf in leaves:
        if type(leaf) is not Tensor and type(leaf) is not Parameter:
            return None, leaves
        parts.append((leaf.dtype, leaf.shape, leaf.device))
    return (_TREE, spec, tuple(parts)), leaves


MAX_MEMOS = 8


def remember(
    entry: _cache.Entry,
    args: tuple[Any, ...],
    in_dims: Any,
    dims: tuple[Any, ...],
    kinds: list[str],
    classes: tuple[int, ...],
    variant: _cache.Variant,
) -> None:
    """Keep a general lookup's hit for the warm calls after it, where it qualifies: a
    traced variant whose plan runs without guards, arguments that are ``Ragged`` values
    (mapped), tensors, or shared containers of tensors, no autocast. An entry keeps the last
    :data:`MAX_MEMOS` (one function called on inputs of a few signatures, or with a
    few closures: each finds its own)."""
    if variant.failure is not None or not variant.plans or not eligible(variant.plans[0]):
        return
    if not any(v is variant for v in entry.variants):
        return  # not cached (f reads a tensor the walk does not find): traced at every call
    if torch._C._is_any_autocast_enabled() or type(in_dims) not in (int, type(None), tuple):
        return
    keys = tuple(_key(a, d) for a, d in zip(args, dims, strict=True))
    if any(k is None for k in keys):
        return
    axes = sum(a.num_ragged for a in args if type(a) is Ragged)
    memo = Memo(
        classes=classes if axes >= 2 else None,
        count=len(args),
        dims=dims,
        dtype=torch.get_default_dtype(),
        in_dims=in_dims,
        keys=keys,
        kinds=kinds,
        flat=all(
            type(a) is not dict and type(a) is not list and type(a) is not tuple for a in args
        ),
        plan=variant.plans[0],
        variant=variant,
    )
    kept = [m for m in entry.warm if not (m.variant is variant and m.keys == keys)]
    entry.warm = [memo, *kept[: MAX_MEMOS - 1]]


def _same_in_dims(given: Any, memo: Memo) -> bool:
    if given is memo.in_dims:
        return True
    if type(given) is not type(memo.in_dims):
        return False
    if type(given) is tuple:
        # entries compared one by one only when they are what the general path accepts
        return all(d is None or type(d) is int for d in given) and given == memo.in_dims
    return given == memo.in_dims


def _batch(args: tuple[Any, ...], memo: Memo) -> tuple[int, Any, list[Any]] | None:
    """``(batch size, device, flat leaves)`` when every argument matches its key in
    ``memo`` and the mapped ones agree on the batch size, else ``None``."""
    batch_size = None
    device = None
    leaves = list(args) if memo.flat else []
    for a, d, want in zip(args, memo.dims, memo.keys, strict=True):
        if not memo.flat and want[0] is _TREE:
            key, inner = _container_key(a)
            if key != want:
                return None
            leaves.extend(inner)
            continue
        if _key(a, d) != want:
            return None
        if not memo.flat:
            leaves.append(a)
        if d is None:
            continue
        if type(a) is Ragged:
            size = a.offsets.shape[0] - 1
            if device is None:
                device = a.values.device
        else:
            size = a.shape[0]
            if device is None:
                device = a.device
        if batch_size is None:
            batch_size = size
        elif size != batch_size:
            return None
    return None if batch_size is None else (batch_size, device, leaves)


def call(
    f: Any,
    args: tuple[Any, ...],
    in_dims: Any,
    strict: bool,
    randomness: str,
    chunk_elements: Any,
) -> Any:
    """``map(f, *args, ...)`` by a remembered hit, or :data:`MISS`."""
    if torch.compiler.is_compiling():
        return MISS
    key = _cache.function_key(f)
    entry = _cache.CACHE.get(key)
    if entry is None or not entry.warm:
        return MISS
    if randomness not in ("different", "same") or tracing():
        return MISS
    if chunk_elements is None:
        budget = DEFAULT_CHUNK_ELEMENTS
    elif type(chunk_elements) is int and chunk_elements >= 0:
        budget = chunk_elements
    else:
        return MISS
    if torch._C._is_any_autocast_enabled():
        return MISS
    dtype = torch.get_default_dtype()
    for memo in entry.warm:
        if len(args) != memo.count or memo.dtype is not dtype or not _same_in_dims(in_dims, memo):
            continue
        found = _batch(args, memo)
        if found is None:
            continue
        batch_size, device, leaves = found
        if memo.classes is not None and size_classes(leaves, memo.kinds) != memo.classes:
            continue
        plan = memo.plan
        variant = memo.variant
        lifted: list[Any] = [None] * len(variant.deps.lifted)
        if not variant.deps.check(f, lifted):
            continue
        entry.hits += 1
        try:
            _cache.CACHE.move_to_end(key)  # (another thread may have dropped it since)
        except KeyError:
            pass
        ctx, inputs = make_ctx(plan, leaves, batch_size, device, lifted, randomness)
        if budget and batch_size > 1 and not within_budget(plan, leaves, batch_size, budget):
            # maybe groups of samples: as the general path
            args_ = (leaves, memo.kinds, lifted, budget, strict, randomness, None)
            return run_chunked(plan, ctx, inputs, *args_)
        ctx.tiles = tiles = budget > 0
        prep = prepared(plan)
        if prep is None or (tiles and (prep.has_chains or (prep.has_blocks and _blocks.ENABLED))):
            return run(plan, ctx, inputs, strict, None)
        return run_prepared(prep, ctx, inputs, strict)
    return MISS


__all__ = ["MAX_MEMOS", "MISS", "call", "remember"]
