"""Layout: the static dim order of one sample of a ``Ragged`` value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ._errors import describe, fail


class Axis(NamedTuple):
    """One logical axis of a sample: ragged axis ``index`` or dense axis ``index``.

    A ragged axis ``k`` is column ``k`` of ``sizes``; the ragged axes are stored
    row-major in ``k`` order in the packed leading axis of ``values``. A dense
    axis ``j`` is axis ``1 + j`` of ``values``. A ``nested`` ragged axis ``k``
    has one size per element of ragged axis ``k - 1`` (documents of sentences
    of tokens): its partition is ``row_offsets[k - 1]`` of the value.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 5), torch.zeros(3, 5)])
        >>> x.layout.axes
        (Axis(ragged=True, index=0, nested=False), Axis(ragged=False, index=0, nested=False))
    """

    ragged: bool
    index: int  # type: ignore[assignment]  # field shadows tuple.index on purpose
    nested: bool = False


RAGGED_NAMES = ("N", "M", "K", "L", "P", "Q")
# a chain of nested axes reads outer to inner: sentences of tokens, graphs of nodes of edges
NESTED_NAMES = ("S", "L", "E", "F", "G", "H")


def _parse(code: str) -> tuple[Axis, ...]:
    return tuple(Axis(part[0] != "d", int(part[1:]), part[0] == "n") for part in code.split())


def _letter(axis: Any) -> str:
    if len(axis) == 3 and axis[2]:
        return "n"
    return "r" if axis[0] else "d"


def _checked(code: Any) -> str:
    """``code`` if it is a well-formed layout code, else ``RaggedError``."""
    if not isinstance(code, str):
        raise fail(
            "Layout", f"expected a layout code string or a tuple of Axis, got {describe(code)}"
        )
    parts = code.split()
    if not all(p[:1] in ("r", "d", "n") and p[1:].isdigit() and p[1:].isascii() for p in parts):
        raise fail(
            "Layout",
            f"expected a code like 'r0 d0' (r/n/d and an index per axis), got {code!r}",
        )
    parsed = _parse(code)
    ragged = sorted(a.index for a in parsed if a.ragged)
    dense = sorted(a.index for a in parsed if not a.ragged)
    if ragged != list(range(len(ragged))) or dense != list(range(len(dense))):
        raise fail("Layout", f"expected ragged and dense axes numbered 0..n-1 each, got {code!r}")
    nested = [a for a in parsed if a.nested]
    if nested:
        chain = [a for a in parsed if a.ragged]
        if [a.index for a in chain] != ragged or chain[0].nested:
            raise fail(
                "Layout",
                "expected a nested layout to hold one chain of ragged axes r0 n1 n2 ... in "
                "logical order (each nested in the one before, or r: a rectangle with it), "
                f"got {code!r}",
            )
    return " ".join(parts)


# eager calls read parsed layouts from here (a handful of distinct codes per program)
_PARSED: dict[str, tuple[Axis, ...]] = {}


@dataclass(frozen=True)
class Layout:
    """Logical axis order of one sample (the batch axis is not included).

    ``axes[a]`` says what logical sample axis ``a`` (batched logical axis
    ``a + 1``) is. Nothing here depends on the data: two batches with different
    lengths share a layout, so compiled code does not specialise on lengths.

    Build it from a tuple of :class:`Axis`; it is stored as a short string
    (``"d0 r0 r1 d1"``) and ``axes`` is parsed from it. Why: under
    ``torch.compile(dynamic=True)`` dynamo turns the int attributes of an input
    into symbols, and in torch 2.13 ``Axis(True, 1) == layout.axes[2]`` then
    silently gave False; strings always stay constants.

    Raises:
        ValueError: the axes do not number the ragged axes and the dense axes each
            ``0..n-1``.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(3, 2, 3), torch.zeros(4, 2, 4)], ragged_dims=(1, 3))
        >>> x.layout, x.layout.axes[1]
        (Layout('r0 d0 r1'), Axis(ragged=False, index=0, nested=False))
        >>> raggedfn.Layout.standard(1, 1).describe((8,))
        '(N*, 8)'
    """

    code: str

    if TYPE_CHECKING:  # the generated __init__ also takes a tuple of Axis

        def __init__(self, code: str | tuple[Axis, ...]) -> None: ...

    def __post_init__(self) -> None:
        code: Any = self.code
        if not isinstance(code, str):
            if not isinstance(code, (tuple, list)) or not all(
                isinstance(a, tuple) and len(a) in (2, 3) for a in code
            ):
                raise fail(
                    "Layout",
                    f"expected a layout code string or a tuple of Axis, got {describe(code)}",
                )
            code = " ".join(f"{_letter(a)}{int(a[1])}" for a in code)
            object.__setattr__(self, "code", code)
        if torch.compiler.is_compiling():
            return  # layouts built inside a compiled graph come from validated ones
        if code not in _PARSED:
            object.__setattr__(self, "code", _checked(code))

    def __setstate__(self, state: Any) -> None:
        """Unpickling (``torch.load``, ``pickle``, ``copy``) validates the code."""
        if not isinstance(state, dict) or set(state) != {"code"}:
            raise fail("Layout.__setstate__", f"expected {{'code': str}}, got {describe(state)}")
        object.__setattr__(self, "code", _checked(state["code"]))

    @property
    def axes(self) -> tuple[Axis, ...]:
        """One :class:`Axis` per logical sample axis."""
        if torch.compiler.is_compiling():  # parse: constants for dynamo, no global state
            return _parse(self.code)
        found = _PARSED.get(self.code)
        if found is None:
            found = _PARSED[self.code] = _parse(self.code)
        return found

    def __repr__(self) -> str:
        return f"Layout({self.code!r})"

    @staticmethod
    def standard(num_ragged: int, num_dense: int, nested: bool = False) -> Layout:
        """Ragged axes first, then dense axes, each in storage order.

        ``nested``: the ragged axes form one chain, each nested in the one before.
        """
        key = (num_ragged, num_dense, nested)
        # eagerly a frozen Layout per (R, D, nested) is reused: every with_values of new
        # dense axes asks for one; under compile the ints may be symbolic, build afresh
        found = None if torch.compiler.is_compiling() else _STANDARD.get(key)
        if found is None:
            found = Layout(
                tuple(Axis(True, k, nested and k > 0) for k in range(num_ragged))
                + tuple(Axis(False, j) for j in range(num_dense))
            )
            if not torch.compiler.is_compiling():
                _STANDARD[key] = found
        return found

    @staticmethod
    def from_ragged_positions(
        rank: int, positions: tuple[int, ...], nested: bool | tuple[bool, ...] = False
    ) -> Layout:
        """A layout of ``rank`` sample axes whose ragged ones sit at ``positions``.

        Ragged axes are numbered in increasing position, dense axes likewise;
        ``nested`` makes them one chain (each nested in the one before), or gives
        per ragged axis whether it is nested (else rectangular with the one before).
        """
        axes: list[Axis] = []
        k = j = 0
        for a in range(rank):
            if a in positions:
                letter = nested if isinstance(nested, bool) else nested[k]
                axes.append(Axis(True, k, letter and k > 0))
                k += 1
            else:
                axes.append(Axis(False, j))
                j += 1
        return Layout(tuple(axes))

    @property
    def rank(self) -> int:
        # one letter-digit group per axis, separated by spaces: no parse on every call
        return self.code.count(" ") + 1 if self.code else 0

    @property
    def num_ragged(self) -> int:
        # counting letters in the code: C-level calls, cheap on every value construction
        return self.code.count("r") + self.code.count("n")

    @property
    def num_nested(self) -> int:
        """Number of ``row_offsets`` tensors: in a value with nested ragged axes every
        ragged axis after the first has one (rectangular ones too); else 0."""
        return self.num_ragged - 1 if "n" in self.code else 0

    @property
    def num_dense(self) -> int:
        return self.code.count("d")

    def position(self, axis: Axis) -> int:
        """The logical sample position of ``axis``."""
        return self.axes.index(axis)

    def physical_to_logical(self) -> tuple[int, ...]:
        """Permutation taking a physical sample ``[*ragged sizes, *dense]`` to logical order.

        ``physical.permute(perm)`` is the logical sample.
        """
        r = self.num_ragged
        return tuple(a.index if a.ragged else r + a.index for a in self.axes)

    def logical_to_physical(self) -> tuple[int, ...]:
        """Inverse of :meth:`physical_to_logical`."""
        perm = self.physical_to_logical()
        inverse = [0] * len(perm)
        for logical, physical in enumerate(perm):
            inverse[physical] = logical
        return tuple(inverse)

    def describe(self, dense_shape: tuple[int, ...]) -> str:
        """Logical sample shape as text, ragged axes as ``N*``, ``M*``, ..."""
        names = NESTED_NAMES if self.num_nested else RAGGED_NAMES
        parts = [
            f"{names[a.index % len(names)]}*"
            if a.ragged
            else f"{dense_shape[a.index]}"  # an f-string: dynamo refuses str() of a SymInt
            for a in self.axes
        ]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


# Layout.standard's eager answers, by (num_ragged, num_dense, nested)
_STANDARD: dict[tuple[int, int, bool], Layout] = {}
