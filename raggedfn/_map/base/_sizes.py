"""Per-sample sizes: symbolic size expressions compiled to tensor evaluators.

A traced size such as ``s0 + s1`` becomes a :class:`Sz`: a canonical text key
(equal keys mean equal sizes for every sample) and a closure that evaluates
the expression on ``[B]`` size tensors. All sympy work happens here, when a
trace is planned; running a plan only calls the closures, which are plain
torch code (``torch.compile`` traces them without seeing sympy).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.utils._sympy.functions as symfn
from torch import Tensor

Env = dict[str, Tensor]
Evaluator = Callable[[Env], Any]


class Unsupported(Exception):
    """A batching rule or a size expression cannot handle this case (not a user error)."""


class SampleRaises(Exception):
    """A batching rule found a sample for which ``f`` raises in the loop (torch refuses
    it there: an index past its end, ``amax`` of an empty axis). Never reaches the
    caller: ``map`` then runs ``f`` per sample, which raises ``f``'s own exception for
    the first such sample, with a note naming it (the message here is the fallback)."""


class Sz:
    """One per-sample size: ``key`` identifies it, ``fn(env)`` evaluates it to ``[B]``;
    ``expr``: its sympy expression where it came from a trace (plan-time reasoning only)."""

    __slots__ = ("const", "expr", "fn", "key")

    def __init__(self, key: str, fn: Evaluator, const: int | None = None, expr: Any = None) -> None:
        self.key = key
        self.fn = fn
        self.const = const
        self.expr = expr

    @staticmethod
    def constant(value: int) -> Sz:
        number = int(value)

        def fn(env: Env) -> int:
            return number

        return Sz(str(number), fn, number)

    def __repr__(self) -> str:
        return self.key


def _torch_op(name: str) -> Callable[..., Any]:
    def both(a: Any, b: Any) -> Any:
        if name == "max":
            return torch.maximum(_t(a, b), _t(b, a)) if _any_tensor(a, b) else max(a, b)
        if name == "min":
            return torch.minimum(_t(a, b), _t(b, a)) if _any_tensor(a, b) else min(a, b)
        raise AssertionError(name)

    return both


def _any_tensor(*xs: Any) -> bool:
    return any(isinstance(x, Tensor) for x in xs)


def _t(a: Any, like: Any) -> Tensor:
    if isinstance(a, Tensor):
        return a
    return torch.full_like(like, a) if isinstance(like, Tensor) else torch.tensor(a)


def _nonzero(b: Any) -> Any:
    # a guard such as Mod(s0, s0**2) is only meaningful for s0 > 0; with a zero
    # divisor evaluate it as if dividing by 1 (the guard then decides, conservatively)
    if isinstance(b, Tensor):
        return torch.where(b == 0, torch.ones_like(b), b)
    return b if b != 0 else 1


def _floordiv(a: Any, b: Any) -> Any:
    b = _nonzero(b)
    if _any_tensor(a, b):
        return torch.div(a, b, rounding_mode="floor")
    return a // b


def _mod(a: Any, b: Any) -> Any:
    b = _nonzero(b)
    if _any_tensor(a, b):
        return torch.remainder(a, b)
    return a % b


def _and(a: Any, b: Any) -> Any:
    return (a & b) if _any_tensor(a, b) else (a and b)


def _or(a: Any, b: Any) -> Any:
    return (a | b) if _any_tensor(a, b) else (a or b)


def _not(a: Any) -> Any:
    return ~a if isinstance(a, Tensor) else (not a)


def _to_float(a: Any) -> Any:
    return a.double() if isinstance(a, Tensor) else float(a)


def compile_expr(expr: Any) -> Evaluator:
    """A closure evaluating sympy ``expr`` on an env of ``[B]`` size tensors."""
    if isinstance(expr, (int, float, bool)):
        return lambda env: expr
    if expr is sympy.true:
        return lambda env: True
    if expr is sympy.false:
        return lambda env: False
    if isinstance(expr, sympy.Symbol):
        name = expr.name
        return lambda env: env[name]
    if isinstance(expr, sympy.Integer):
        value = int(expr)
        return lambda env: value
    if isinstance(expr, (sympy.Rational, sympy.Float)):
        real = float(expr)
        return lambda env: real
    args = [compile_expr(a) for a in expr.args]
    binary: dict[type, Callable[[Any, Any], Any]] = {
        sympy.Eq: lambda a, b: a == b,
        sympy.Ne: lambda a, b: a != b,
        sympy.StrictLessThan: lambda a, b: a < b,
        sympy.LessThan: lambda a, b: a <= b,
        sympy.StrictGreaterThan: lambda a, b: a > b,
        sympy.GreaterThan: lambda a, b: a >= b,
        symfn.FloorDiv: _floordiv,
        symfn.CleanDiv: _floordiv,
        symfn.Mod: _mod,
        symfn.PythonMod: _mod,
        symfn.IntTrueDiv: lambda a, b: a / b,
        symfn.FloatTrueDiv: lambda a, b: a / b,
        symfn.PowByNatural: lambda a, b: a**b,
        symfn.FloatPow: lambda a, b: a**b,
        sympy.Pow: lambda a, b: a**b,
        symfn.CeilDiv: lambda a, b: -_floordiv(-a, b),
    }
    for kind, fn in binary.items():
        if type(expr) is kind:
            left, right = args
            return _binary(fn, left, right)
    if isinstance(expr, sympy.Add):
        return lambda env: _fold(lambda a, b: a + b, [a(env) for a in args])
    if isinstance(expr, sympy.Mul):
        return lambda env: _fold(lambda a, b: a * b, [a(env) for a in args])
    if isinstance(expr, sympy.And):
        return lambda env: _fold(_and, [a(env) for a in args])
    if isinstance(expr, sympy.Or):
        return lambda env: _fold(_or, [a(env) for a in args])
    if isinstance(expr, sympy.Not):
        (inner,) = args
        return lambda env: _not(inner(env))
    if isinstance(expr, symfn.Max):
        return lambda env: _fold(_torch_op("max"), [a(env) for a in args])
    if isinstance(expr, symfn.Min):
        return lambda env: _fold(_torch_op("min"), [a(env) for a in args])
    if isinstance(expr, symfn.ToFloat):
        (inner,) = args
        return lambda env: _to_float(inner(env))
    if isinstance(expr, symfn.ModularIndexing):
        base, div, mod = args
        return lambda env: _mod(_floordiv(base(env), div(env)), mod(env))
    raise Unsupported(f"size expression {expr} ({type(expr).__name__})")


def _binary(fn: Callable[[Any, Any], Any], left: Evaluator, right: Evaluator) -> Evaluator:
    return lambda env: fn(left(env), right(env))


def _fold(fn: Callable[[Any, Any], Any], values: list[Any]) -> Any:
    out = values[0]
    for v in values[1:]:
        out = fn(out, v)
    return out


def _exact_division(expr: Any) -> Any:
    """``(s0**2) // s0`` -> ``s0``: torch keeps floor divisions that divide exactly
    (reshapes inside decompositions make them); equal sizes need equal keys."""

    def simplify(a: Any, b: Any) -> Any:
        quotient = sympy.expand(sympy.cancel(a / b))
        _, denominator = sympy.fraction(sympy.together(quotient))
        # exact only for a polynomial with integer coefficients: (s + 1) // 2 is not s/2 + 1/2
        integral = all(term.as_coeff_Mul()[0].is_integer for term in sympy.Add.make_args(quotient))
        if denominator == 1 and quotient.is_polynomial() and integral:
            return quotient
        return symfn.FloorDiv(a, b)

    if not expr.has(symfn.FloorDiv):
        return expr
    return expr.replace(symfn.FloorDiv, simplify)


def sz_of(expr: Any, replace: dict[Any, Any] | None = None) -> Sz | int:
    """A traced size (int or symbolic) as a static int or a :class:`Sz`.

    ``replace`` maps expressions to equal ones (from the trace's equality guards,
    which every sample is checked against): two spellings of one size, such as
    ``Max(0, s - Min(1, s))`` and ``Max(0, s - 1)``, get one key.
    """
    if isinstance(expr, torch.SymInt):
        expr = expr.node.expr
    if isinstance(expr, int):
        return expr
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if not expr.free_symbols:
        return int(expr)
    for _ in range(8):
        if not replace:
            break
        replaced = expr.xreplace(replace)
        if replaced == expr:
            break
        expr = replaced
    expr = sympy.expand(_exact_division(expr))
    if not expr.free_symbols:
        return int(expr)
    return Sz(str(expr), compile_expr(expr), expr=expr)


def product_key(sizes: tuple[Sz, ...]) -> str:
    """Canonical text of a product of sizes (pure Python: safe while compiling)."""
    return "*".join(sorted(f"({s.key})" for s in sizes))


def equalities(exprs: list[Any]) -> dict[Any, Any]:
    """From ``Eq(a, b)`` guards: each larger side mapped to the smaller one."""
    out: dict[Any, Any] = {}
    for expr in exprs:
        if not isinstance(expr, sympy.Eq):
            continue
        a, b = expr.lhs, expr.rhs
        if not (a.free_symbols and b.free_symbols) or a == b:
            continue
        small, large = sorted((a, b), key=lambda e: (sympy.count_ops(e), len(str(e)), str(e)))
        out.setdefault(large, small)
    return out


_UNBACKED = re.compile(r"(u|zuf)[0-9]+")


def is_unbacked(name: str) -> bool:
    """Whether ``name`` is a symbol the trace made for a value read from the data: an
    integer (``u0``: a mask's count, ``int(t.sum())``) or a float (``zuf0``: ``.item()``
    of a float tensor)."""
    return _UNBACKED.fullmatch(name) is not None
