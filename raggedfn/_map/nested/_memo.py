"""Example results remembered from the last record of the same function.

A record computes every op ``f`` applies on two small example samples, only for
their types and shapes (the batch runs the record, not the examples). A warm call
of the same ``f`` applies the same ops in the same order: where an op, its position
and its arguments match the last record's (stand-ins by number, tensors by shape,
dtype, device and ``requires_grad``, other arguments by value), its example results
are the last record's. The first op that differs ends the reuse for the rest of the
run. Results that require grad are not kept (they would keep the graph, and the
tensors it holds, alive), nor is anything under a ``torch.func`` transform.
"""

from __future__ import annotations

import enum
import types
from typing import Any

import torch
from torch import Tensor

from ..._ragged import Ragged

_PLAIN: tuple[type, ...] = (int, float, bool, str, type(None), type(Ellipsis), slice)
_PLAIN += (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)
_CALLABLE: tuple[type, ...] = (types.FunctionType, types.BuiltinFunctionType)
_CALLABLE += (types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodWrapperType)
_CALLABLE += (torch._ops.OpOverload,)

MAX_ENTRIES = 32
_LAST: dict[Any, list[tuple[Any, Any]]] = {}


class NoKey(Exception):
    """An argument the memo cannot compare."""


def leaf_key(value: Any, ref_of: Any) -> Any:
    ref = ref_of(value)
    if ref is not None:
        return ref
    if isinstance(value, Tensor):
        if value.dtype == torch.bool:  # a mask: the shapes it gives follow its data
            raise NoKey
        return ("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, Ragged):
        raise NoKey
    if isinstance(value, _PLAIN) or isinstance(value, _CALLABLE):
        return value
    raise NoKey


def start(key: Any) -> list[tuple[Any, Any]] | None:
    """The last record's example results for this key, or None (no reuse)."""
    if key is None or torch._C._are_functorch_transforms_active():
        return None
    return _LAST.get(key)


def keep(key: Any, memo: list[tuple[Any, Any]]) -> None:
    if key is None or torch._C._are_functorch_transforms_active():
        return
    if len(_LAST) >= MAX_ENTRIES and key not in _LAST:
        _LAST.pop(next(iter(_LAST)))
    _LAST[key] = memo


def requires_grad(results: Any) -> bool:
    stack = list(results)
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, Tensor) and value.requires_grad:
            return True
        elif isinstance(value, Ragged) and value.values.requires_grad:
            return True
    return False
