"""``map`` over nested values, batched: record ``f`` on stand-in samples, run the
record on the batch; or say why not (then ``map`` runs the per-sample loop)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import _get_current_function_mode_stack as _function_modes
from torch.utils import _pytree as pytree
from torch.utils._device import DeviceContext

from ..._ragged import Ragged
from ..base._report import MapReport
from . import _memo, _record_ops  # noqa: F401  (binds the stand-ins' handlers and operators)
from ._replay import Segment, replay
from ._stand_ins import (
    DenseStandIn,
    NotRecordable,
    Recorder,
    Ref,
    SampleStandIn,
    is_leaf,
    recording,
)

# two example documents of different sizes (sentences, tokens: an empty sentence too)
_EXAMPLE_LENGTHS = ((3, 1), (2, 0, 4))

RunMap = Callable[[Callable[..., Any], tuple[Any, ...], tuple[Any, ...], MapReport | None], Any]


class NotBatched(Exception):
    """Why the record cannot run (the per-sample loop runs)."""


_EXAMPLES: dict[Any, tuple[Ragged, Ragged]] = {}


def _examples(x: Ragged) -> tuple[Ragged, Ragged]:
    """Two one-level samples with ``x``'s sample layout, dtype, device and dense shape
    (zeros, kept: they are immutable, and ops remember their index tensors)."""
    dense = tuple(x.values.shape[1:])
    key = (x.layout, x.values.dtype, x.values.device, dense)
    found = _EXAMPLES.get(key)
    if found is None:
        if len(_EXAMPLES) >= 32:
            _EXAMPLES.clear()
        found = _EXAMPLES[key] = _make_examples(x, dense)
    return found


def _make_examples(x: Ragged, dense: tuple[int, ...]) -> tuple[Ragged, Ragged]:
    from ..._construct import from_list  # constructors sit beside the value layer

    with torch.no_grad():
        docs = [
            [torch.zeros((n, *dense), dtype=x.dtype, device=x.device) for n in lengths]
            for lengths in _EXAMPLE_LENGTHS
        ]
        example = from_list(docs)
    if example.layout != x.layout or x.layout.num_nested != 1:
        raise NotBatched(f"a nested value of layout {x.layout} (only r0 n1 d...)")
    return example[0], example[1]


def _stand_ins(
    leaves: list[Any], kinds: list[str], rec: Recorder
) -> tuple[list[Any], dict[Ref, Any]]:
    stand_ins: list[Any] = []
    env: dict[Ref, Any] = {}
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged" and leaf.row_offsets:
            ref = rec.new_ref()
            stand_ins.append(SampleStandIn.make(_examples(leaf), ref))
            env[ref] = leaf
        elif kind == "ragged":
            raise NotBatched("a one-level ragged argument beside a nested one")
        elif kind == "dense":
            ref = rec.new_ref()
            row = leaf.new_zeros(leaf.shape[1:])
            stand_ins.append(DenseStandIn.make((row, row), ref))
            env[ref] = leaf
        else:
            stand_ins.append(leaf)
    return stand_ins, env


def _memo_key(f: Callable[..., Any], leaves: list[Any], kinds: list[str]) -> Any:
    """Which last record's example results a record of ``f`` may compare with: its code
    and what decides the examples (reuse itself compares every op's arguments)."""
    signature: list[Any] = []
    for leaf, kind in zip(leaves, kinds, strict=True):
        if kind == "ragged":
            signature.append((leaf.layout, leaf.dtype, leaf.device, tuple(leaf.values.shape[1:])))
        elif kind == "dense":
            signature.append((tuple(leaf.shape[1:]), leaf.dtype, leaf.device))
    code = getattr(f, "__code__", None) or type(f)
    state = (torch.is_grad_enabled(), torch.get_default_dtype())
    if torch._C._is_any_autocast_enabled():
        return None
    return (code, tuple(signature), state)


def record(
    f: Callable[..., Any],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    outside: Any = None,
) -> tuple[Recorder, dict[Ref, Any], Any]:
    """Run ``f`` once on stand-ins: its record, the batch's values by ref, its output
    (``outside``: a mode entered around ``f``, ``_outer.Outside`` for a compiled region)."""
    key = _memo_key(f, leaves, kinds)
    rec = Recorder(_memo.start(key))
    stand_ins, env = _stand_ins(leaves, kinds, rec)
    args = pytree.tree_unflatten(stand_ins, treespec)
    with recording(rec), outside if outside is not None else contextlib.nullcontext():
        try:
            out = f(*args)
        except NotRecordable:
            pass
        except Exception as error:
            if rec.failure is None:
                rec.failure = f"f raised {type(error).__name__} on a stand-in sample: {error}"
    if rec.failure is not None:
        raise NotBatched(rec.failure)
    _memo.keep(key, rec.memo)
    flat, spec = pytree.tree_flatten(out, is_leaf=is_leaf)
    template = []
    for leaf in flat:
        if not isinstance(leaf, (SampleStandIn, DenseStandIn)):
            raise NotBatched(f"f returns {type(leaf).__name__}, not a value of the sample")
        template.append(object.__getattribute__(leaf, "_ref"))
    return rec, env, pytree.tree_unflatten(template, spec)


def nested_map(
    f: Callable[..., Any],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    run_map: RunMap,
    randomness: str,
    report: MapReport | None,
) -> Any:
    """``map(f, ...)`` over nested values, batched; raises ``NotBatched`` with the reason
    where the record cannot stand for ``f`` (nothing has run on the batch then)."""
    if randomness != "different":  # one draw for all samples, or none: the loop's
        raise NotBatched(f"randomness={randomness!r}")
    modes = [m for m in _function_modes() if not isinstance(m, DeviceContext)]
    if modes:
        # a user's mode sees (and may change) every torch call of f: on the stand-ins and
        # the batch it would see other calls than the loop's
        raise NotBatched(f"a torch function mode is active ({type(modes[-1]).__name__})")
    rec, env, output = record(f, leaves, kinds, treespec)
    batched: dict[str, int] = {}
    parts: list[MapReport] = []

    def run_segment(segment: Segment, inputs: tuple[Any, ...], shared: list[Tensor]) -> Any:
        part = None if report is None else MapReport()
        if part is not None:
            parts.append(part)
        dims = (0,) * len(inputs) + (None,) * len(shared)
        return run_map(segment, (*inputs, *shared), dims, part)

    try:
        out = replay(rec.nodes, env, output, run_segment, batched)
    except NotRecordable as error:
        raise NotBatched(str(error)) from None
    if report is not None:
        report.batched = batched
        for k, part in enumerate(parts):
            where = f"segment {k} of torch code on per-sample tensors"
            for name, n in part.batched.items():
                report.batched[name] = report.batched.get(name, 0) + n
            for name, why in part.fallback.items():
                report.fallback[f"{name} ({where})"] = why
            if part.whole_loop is not None:
                report.fallback[where] = part.whole_loop
            if part.partial_loop is not None:
                report.fallback[where] = part.partial_loop
            report.guards.extend(part.guards)
            report.unbatched.update(part.unbatched)
    return out
