"""Public pure functions over ``Ragged`` values, grouped by kind.

Each submodule defines ``__all__``; this package re-exports them all.
"""

from . import _operators  # noqa: F401  # binds Ragged's operators (+, @, <, ...)
from ._attention import attention
from ._broadcast import broadcast_tensors
from ._compare import eq, ge, gt, le, lt, ne
from ._compile import dynamic_shapes, mark_dynamic
from ._elementwise import abs, add, apply, div, floor_divide, mul, neg, pow, sub, where
from ._gather import gather, take_along_dim
from ._grouped import group_by, segment_matmul
from ._matmul import matmul
from ._nn import layer_norm, linear, rms_norm
from ._products import einsum
from ._reduce import (
    all,
    amax,
    amin,
    any,
    argmax,
    argmin,
    logsumexp,
    mean,
    norm,
    prod,
    std,
    sum,
    var,
)
from ._reshape import flatten, reshape, unflatten
from ._scan import cumsum
from ._select import cat, masked_select, narrow, pairs
from ._shape import contiguous, permute, squeeze, transpose, unsqueeze
from ._softmax import log_softmax, softmax
from ._sort import argsort, sort, topk

__all__ = [
    "einsum",
    "matmul",
    "attention",
    "argsort",
    "cat",
    "gather",
    "masked_select",
    "narrow",
    "pairs",
    "sort",
    "take_along_dim",
    "topk",
    "broadcast_tensors",
    "abs",
    "add",
    "apply",
    "div",
    "eq",
    "floor_divide",
    "ge",
    "gt",
    "le",
    "lt",
    "mul",
    "ne",
    "neg",
    "pow",
    "sub",
    "where",
    "group_by",
    "segment_matmul",
    "layer_norm",
    "linear",
    "rms_norm",
    "contiguous",
    "flatten",
    "permute",
    "reshape",
    "squeeze",
    "transpose",
    "unflatten",
    "unsqueeze",
    "all",
    "amax",
    "amin",
    "any",
    "argmax",
    "argmin",
    "logsumexp",
    "mean",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
    "cumsum",
    "log_softmax",
    "softmax",
    "dynamic_shapes",
    "mark_dynamic",
]

# every public op hands calls with a stand-in argument to its handler (_dispatch.py)
from .._dispatch import dispatching as _dispatching

for _name in __all__:
    if _name not in ("dynamic_shapes", "mark_dynamic"):
        globals()[_name] = _dispatching(globals()[_name])
del _name
