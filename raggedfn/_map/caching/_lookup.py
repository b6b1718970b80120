"""A ``raggedfn.map`` call's arguments flattened and classified (:func:`prepare`), what
the dependency walk starts from (:func:`roots_of`), and the cached variant they pick
(:func:`lookup`): shared by the eager call (``_api``) and the compiled one
(``_compiled``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..._errors import describe, fail
from ..._ragged import Ragged
from ..tracing._signature import leaf_kinds, signature, size_classes
from ..tracing._trace import LOCK, is_ragged_leaf
from . import _cache
from ._cache import Variant
from ._groups import warn_once
from ._plans import new_variant

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


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


# the tree spec (and its text) of a tuple of n leaves, the common call: every argument
# a Ragged value or a tensor (a pytree spec is immutable: one per n serves every call)
_FLAT_SPECS: dict[int, tuple[Any, str]] = {}


def flat_spec(count: int) -> tuple[Any, str]:
    """``(tree spec, str(tree spec))`` of a tuple of ``count`` leaves."""
    found = _FLAT_SPECS.get(count)
    if found is None:
        spec = pytree.tree_structure(tuple(range(count)))
        found = _FLAT_SPECS[count] = (spec, str(spec))
    return found


def spec_text(treespec: Any) -> str:
    """``str(treespec)``, read from :func:`flat_spec` for the specs it made."""
    found = _FLAT_SPECS.get(treespec.num_children)
    if found is not None and found[0] is treespec:
        return found[1]
    return str(treespec)


def prepare(fn_name: str, args: tuple[Any, ...], in_dims: Any) -> tuple[Any, ...]:
    dims = _normalize_in_dims(fn_name, in_dims, len(args))
    # while compiling, the general path: the memo of flat specs is a dict that a trace
    # made during the compile fills, and dynamo's guards on it would fail at once
    if not torch.compiler.is_compiling() and all(
        type(a) is Ragged or type(a) is torch.Tensor for a in args
    ):
        # each argument is one leaf (is_ragged_leaf of a Ragged, a plain tensor)
        flat = _prepare_flat(fn_name, args, dims)
        if flat is not None:
            return flat
        leaves, treespec = list(args), flat_spec(len(args))[0]
        mapped = [d == 0 for d in dims]
    else:
        leaves, treespec = pytree.tree_flatten(args, is_leaf=is_ragged_leaf)
        mapped = []
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


def _prepare_flat(fn_name: str, args: tuple[Any, ...], dims: tuple[Any, ...]) -> Any:
    """:func:`prepare` of arguments that are all ``Ragged`` values or plain tensors, the
    mapped ones agreeing on one batch size (eagerly); ``None`` for anything else (the
    general path then says what is wrong)."""
    if torch.compiler.is_compiling():
        return None
    kinds: list[str] = []
    batch_size = None
    for a, d in zip(args, dims, strict=True):
        if d is None:
            kinds.append("shared" if type(a) is torch.Tensor else "constant")
            continue
        if type(a) is Ragged:
            kinds.append("ragged")
            size = a.offsets.shape[0] - 1
        elif a.ndim == 0:
            return None
        else:
            kinds.append("dense")
            size = a.shape[0]
        if batch_size is None:
            batch_size = size
        elif size != batch_size:
            return None
    if batch_size is None:
        return None
    return dims, list(args), flat_spec(len(args))[0], kinds, batch_size


def roots_of(f: Any, leaves: list[Any], kinds: list[str]) -> list[tuple[Any, str]]:
    """What the dependency walk starts from: ``f`` and the non-scalar shared constants
    (a module passed with ``in_dims=None`` is read like a captured one)."""
    roots: list[tuple[Any, str]] = [(f, "f")]
    for i, (leaf, kind) in enumerate(zip(leaves, kinds, strict=True)):
        if kind == "constant" and type(leaf) not in _SCALARS:
            roots.append((leaf, f"argument leaf {i}"))
    return roots


def lookup(
    f: Any,
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    dims: Any,
    classes: tuple[int, ...] | None = None,
) -> tuple[Variant, list[Any], _cache.Entry, tuple[int, ...]]:
    """``classes``: the size classes of the ragged axes (default: from the sizes)."""
    if classes is None:
        classes = size_classes(leaves, kinds)
    static = (dims, spec_text(treespec), signature(leaves, kinds), classes, _cache.global_state())
    roots = roots_of(f, leaves, kinds)
    values = [r for r, _ in roots]
    with LOCK:
        entry = _cache.entry_of(f, create=True)
        assert entry is not None
        found = _cache.find(entry, static, values)
        if found is not None:
            entry.hits += 1
            return found[0], found[1], entry, classes
        entry.traces += 1
        variant, lifted, cacheable = new_variant(f, roots, static, leaves, kinds, treespec, classes)
        if cacheable:
            _cache.add(entry, variant)
        else:
            warn_once(
                None,
                "f reads "
                + "; ".join(variant.plans[0].unknown)
                + " from a place raggedfn does not follow (not a closure cell, global, "
                "default, argument, or attribute of those): it is traced again at every "
                "call so that it is never stale; pass it as an argument (in_dims=None)",
            )
        return variant, lifted, entry, classes
