"""Layouts inside the ``map`` interpreter: their axis facts, memoized per layout code
(never read or written while compiling: a cold compile must not guard on a cache)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..._layout import Axis, Layout


class LayoutInfo(NamedTuple):
    """What the rules read of a layout, derived once per layout code.

    ``ragged``: ``(logical position, storage k)`` of each ragged axis, in logical
    order (``ragged_at`` maps the one to the other); ``dense_pos``: the logical
    position of each dense storage axis.
    """

    axes: tuple[Axis, ...]
    ragged: tuple[tuple[int, int], ...]
    ragged_at: dict[int, int]
    dense_pos: tuple[int, ...]


def _layout_info(axes: tuple[Axis, ...]) -> LayoutInfo:
    ragged = tuple((p, a.index) for p, a in enumerate(axes) if a.ragged)
    dense_pos = [0] * (len(axes) - len(ragged))
    for p, a in enumerate(axes):
        if not a.ragged:
            dense_pos[a.index] = p
    return LayoutInfo(axes, ragged, dict(ragged), tuple(dense_pos))


_INFO: dict[str, LayoutInfo] = {}


def info_of(layout: Layout) -> LayoutInfo:
    """The :class:`LayoutInfo` of ``layout`` (a layout is immutable: keyed by its code)."""
    if torch.compiler.is_compiling():
        # no memo read or write while compiling: dynamo guards on a dict it reads, and
        # a key filled later (by the side effect, an eager call, a trace made during the
        # compile) fails that guard (a recompile, or a crash within the same compile)
        return _layout_info(layout.axes)
    found = _INFO.get(layout.code)
    if found is None:
        found = _INFO[layout.code] = _layout_info(layout.axes)
    return found


def axes_of(layout: Layout) -> tuple[Axis, ...]:
    """``layout.axes``, parsed once per layout (it is re-parsed on every access)."""
    return info_of(layout).axes


def num_ragged_of(layout: Layout) -> int:
    return len(info_of(layout).ragged)


def num_dense_of(layout: Layout) -> int:
    return len(info_of(layout).dense_pos)


_LAYOUTS: dict[tuple[Axis, ...], Layout] = {}


def make_layout(axes: tuple[Axis, ...]) -> Layout:
    """``Layout(axes)``, built (and validated) once per distinct axes tuple."""
    key = tuple(axes)
    if torch.compiler.is_compiling():  # no memo (see info_of)
        return Layout(key)
    found = _LAYOUTS.get(key)
    if found is None:
        found = Layout(key)
        _LAYOUTS[key] = found
    return found
