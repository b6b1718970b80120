"""How a raggedfn op applied to stand-ins is recorded: an op on a sample (a one-level
``Ragged``: sentences of tokens) becomes the same op one level deeper on the nested
batch (axis ``k >= 0`` of the sample is axis ``k + 1`` of the batch; negative axes count
from the end in both; ``dim=None``, every axis of the sample, is every axis but the
batch's first). Ops given only per-sample dense tensors are per-sample nodes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ... import ops
from ..._axes import one_level_deeper
from ._stand_ins import DenseStandIn, SampleStandIn, _record, recorder, tree_leaves, tree_map

# ops without an axis argument: the same call on the batch
_SAME = {
    "abs", "add", "sub", "mul", "div", "floor_divide", "pow", "neg", "where", "apply",
    "eq", "ne", "lt", "le", "gt", "ge", "linear", "layer_norm", "rms_norm",
}  # fmt: skip
# ops with a ``dim`` argument (an axis, a tuple of axes or None for every axis)
_DIM = {
    "sum", "mean", "amax", "amin", "logsumexp", "prod", "norm", "var", "std", "all",
    "any", "softmax", "log_softmax", "cumsum",
}  # fmt: skip
_SIGNATURES: dict[Any, inspect.Signature] = {}


def _batch_args(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    if name in _SAME:
        return args, kwargs
    fn = op.__wrapped__
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    x = bound.arguments["x"]
    if not isinstance(x, SampleStandIn):
        recorder().fail(f"raggedfn.{name} of a per-sample tensor and a sample")
    bound.arguments["dim"] = one_level_deeper(bound.arguments.get("dim"), x.ndim)
    return bound.args, bound.kwargs


def handle(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``__raggedfn_function__`` of both stand-ins: record ``op(*args, **kwargs)``."""
    rec = recorder()
    name = op.__name__
    leaves = tree_leaves((args, kwargs))
    samples = any(isinstance(v, SampleStandIn) for v in leaves)
    if not samples:  # per-sample dense tensors only: the op is torch code per sample
        return _record(rec, "sample", op.__wrapped__, op.__wrapped__, args, kwargs)
    if any(isinstance(v, DenseStandIn) for v in leaves):
        rec.fail(f"raggedfn.{name} of a sample and a per-sample dense tensor")
    if name not in _SAME and name not in _DIM:
        rec.fail(f"raggedfn.{name} on a sample has no batched form yet")
    batch_args, batch_kwargs = _batch_args(op, args, kwargs, name)
    out = _record(rec, "batch", op.__wrapped__, op.__wrapped__, args, kwargs)
    node = rec.nodes[-1]  # the batch node runs with the axes one level deeper
    rec.nodes[-1] = node._replace(
        args=tuple(tree_map(_ref_of, batch_args)),
        kwargs=dict(tree_map(_ref_of, batch_kwargs)),
    )
    return out


def _ref_of(value: Any) -> Any:
    if isinstance(value, (SampleStandIn, DenseStandIn)):
        return object.__getattribute__(value, "_ref")
    return value


def _operator(name: str, op: Callable[..., Any], reflected: bool) -> Callable[..., Any]:
    def method(self: Any, other: Any) -> Any:
        return op(other, self) if reflected else op(self, other)

    method.__name__ = name
    return method


_BINARY = {
    "add": ops.add, "sub": ops.sub, "mul": ops.mul, "truediv": ops.div,
    "floordiv": ops.floor_divide, "pow": ops.pow, "matmul": ops.matmul,
}  # fmt: skip
for _op_name, _op in _BINARY.items():
    setattr(SampleStandIn, f"__{_op_name}__", _operator(f"__{_op_name}__", _op, False))
    setattr(SampleStandIn, f"__r{_op_name}__", _operator(f"__r{_op_name}__", _op, True))
for _op_name, _op in {"eq": ops.eq, "ne": ops.ne, "lt": ops.lt, "le": ops.le,
                      "gt": ops.gt, "ge": ops.ge}.items():  # fmt: skip
    setattr(SampleStandIn, f"__{_op_name}__", _operator(f"__{_op_name}__", _op, False))
SampleStandIn.__neg__ = ops.neg  # type: ignore[method-assign,assignment]
SampleStandIn.__abs__ = ops.abs  # type: ignore[method-assign,assignment]
SampleStandIn.__raggedfn_function__ = staticmethod(handle)  # type: ignore[assignment]
DenseStandIn.__raggedfn_function__ = staticmethod(handle)  # type: ignore[assignment]
