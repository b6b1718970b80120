"""Python operators of ``Ragged`` (``x + y``, ``x @ W``, ``t < x``, ...), bound onto the class.

The value module does not import the op layer (DESIGN.md, layering); the
operators are the op layer's, so they are defined and attached here, when
``raggedfn.ops`` is imported (``import raggedfn`` does that).

``__torch_function__`` is for ``torch.compile`` only. Dynamo (torch 2.13) never
calls a user class's dunders when the other operand of a binary operator is a
tensor: it puts the operator straight into the graph unless an operand
overrides ``__torch_function__``, and then calls that with the tensor method
(``Tensor.mul``, ``Tensor.__rsub__``, ...) and the tensor operand first. Eagerly
Python's operator protocol reaches the dunders below, so the override answers
``NotImplemented`` there, and every ``torch.*`` function given a ``Ragged`` value
still raises ``TypeError`` as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._errors import fail
from .._ragged import Ragged
from . import _compare as cmp
from . import _elementwise as ew
from ._matmul import matmul, matmul_fits

__all__: list[str] = []


def _method(name: str, op: Callable[[Any, Any], Any], reflected: bool) -> Callable[[Any, Any], Any]:
    """``op(self, other)``, or ``op(other, self)`` for a reflected operator."""

    def method(self: Ragged, other: Any) -> Any:
        return op(other, self) if reflected else op(self, other)

    method.__name__ = method.__qualname__ = name
    operands = "other, self" if reflected else "self, other"
    method.__doc__ = f"``raggedfn.{op.__name__}({operands})``."
    return method


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": ew.add,
    "sub": ew.sub,
    "mul": ew.mul,
    "truediv": ew.div,
    "floordiv": ew.floor_divide,
    "pow": ew.pow,
    "matmul": matmul,
}
_COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": cmp.eq,
    "ne": cmp.ne,
    "lt": cmp.lt,
    "le": cmp.le,
    "gt": cmp.gt,
    "ge": cmp.ge,
}

for _name, _op in _BINARY.items():
    setattr(Ragged, f"__{_name}__", _method(f"Ragged.__{_name}__", _op, reflected=False))
    setattr(Ragged, f"__r{_name}__", _method(f"Ragged.__r{_name}__", _op, reflected=True))
for _name, _op in _COMPARISONS.items():
    setattr(Ragged, f"__{_name}__", _method(f"Ragged.__{_name}__", _op, reflected=False))
Ragged.__neg__ = ew.neg  # type: ignore[method-assign]
Ragged.__abs__ = ew.abs  # type: ignore[method-assign]


# Under dynamo: the tensor method it passes -> (raggedfn op, whether the operands swap).
# ``x - t`` arrives as ``Tensor.__rsub__(t, x)``, ``t - x`` as ``Tensor.sub(t, x)``.
_T = torch.Tensor
_TENSOR_METHODS: tuple[tuple[Any, Callable[[Any, Any], Any], bool], ...] = (
    (_T.add, ew.add, False),
    (_T.mul, ew.mul, False),
    (_T.sub, ew.sub, False),
    (_T.__rsub__, ew.sub, True),
    (_T.div, ew.div, False),
    (_T.__rdiv__, ew.div, True),
    (_T.__pow__, ew.pow, False),
    (_T.pow, ew.pow, False),
    (_T.__rpow__, ew.pow, True),
    (_T.__floordiv__, ew.floor_divide, False),
    (_T.__rfloordiv__, ew.floor_divide, True),
    (_T.eq, cmp.eq, False),
    (_T.__eq__, cmp.eq, False),
    (_T.ne, cmp.ne, False),
    (_T.__ne__, cmp.ne, False),
    (_T.lt, cmp.lt, False),
    (_T.le, cmp.le, False),
    (_T.gt, cmp.gt, False),
    (_T.ge, cmp.ge, False),
)


def _compiled_matmul(t: Tensor, x: Ragged) -> Any:
    """``x @ t`` or ``t @ x``: dynamo passes both as ``Tensor.matmul(t, x)``.

    The shapes decide; where both products fit, refuse rather than guess.
    """
    fits_left = matmul_fits(t, x)
    fits_right = matmul_fits(x, t)
    if fits_left and fits_right:
        raise fail(
            "matmul",
            "expected x @ W or W @ x to be unambiguous under torch.compile, got shapes where "
            "both fit (torch 2.13 dynamo passes both as Tensor.matmul(W, x)); call "
            "raggedfn.matmul(x, W) or raggedfn.matmul(W, x) instead",
        )
    return matmul(t, x) if fits_left else matmul(x, t)


def _torch_function(
    cls: type,
    func: Any,
    types: Any,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """Binary operators with a tensor operand under ``torch.compile`` (see module docstring)."""
    if not torch.compiler.is_compiling() or kwargs or len(args) != 2:
        return NotImplemented
    first, second = args
    if not isinstance(first, Tensor) or not isinstance(second, Ragged):
        return NotImplemented
    if func is _T.matmul:
        return _compiled_matmul(first, second)
    for method, op, swapped in _TENSOR_METHODS:
        if func is method:
            return op(second, first) if swapped else op(first, second)
    return NotImplemented


Ragged.__torch_function__ = classmethod(_torch_function)  # type: ignore[attr-defined]
