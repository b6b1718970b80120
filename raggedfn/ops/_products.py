"""Per-sample products: ``einsum`` over ragged and dense operands (``matmul``, in
``_matmul.py``, is built on it).

A product whose ragged axes only ride along (one ``Ragged`` operand, every
contracted or combined axis dense, ragged axes kept in storage order) runs as
one dense op on the packed ``values``. Anything else (contracting a ragged axis,
combining two ragged operands, making a pair state) runs per length bucket:
samples of similar size are padded to the bucket's extents and multiplied with
one batched dense call per bucket (see ``_bucket.py``), so the work follows
``sum_i N_i^2`` / ``sum_i N_i^3`` rather than ``B * N_max^k``.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _prims
from .._axes import refuse_nested
from .._errors import describe, fail, shape_text
from .._index import offsets_of
from .._layout import Layout
from .._ragged import Ragged, like
from . import _bucket
from ._nested_products import per_element_einsum

__all__ = ["einsum"]

_LETTERS = string.ascii_letters


def _parse(fn: str, equation: str, count: int) -> tuple[list[str], str]:
    if not isinstance(equation, str):
        raise fail(fn, f"equation must be a string, got {describe(equation)}")
    text = equation.replace(" ", "")
    if "..." in text:
        raise fail(fn, f"equation {equation!r}: ellipsis '...' is not supported; name every axis")
    if "->" not in text:
        raise fail(fn, f"equation {equation!r} must give the output explicitly ('...->...')")
    lhs, rhs = text.split("->")
    inputs = lhs.split(",")
    if len(inputs) != count:
        raise fail(fn, f"equation {equation!r} names {len(inputs)} operands, got {count}")
    for sub in [*inputs, rhs]:
        if not all(c in _LETTERS for c in sub) or len(set(sub)) != len(sub):
            raise fail(
                fn,
                f"equation {equation!r}: subscripts must be distinct letters per operand, "
                f"got {sub!r}",
            )
    missing = sorted(set(rhs) - set("".join(inputs)))
    if missing:
        raise fail(
            fn,
            f"equation {equation!r}: expected every output subscript in an operand, got "
            f"{missing} only in the output",
        )
    return inputs, rhs


class _Spec(NamedTuple):
    """A parsed per-sample einsum that needs buckets (see :func:`einsum`)."""

    inputs: list[str]
    rhs: str
    symbols_of: list[list[str]]  # per operand, the letter of each ragged axis (k order)
    batched_dense: list[int]  # dense operands with a batch axis
    out_symbols: list[str]
    out_layout: Layout

    def encode(self, layouts: list[str]) -> str:
        """A plain string with the operands' layout codes ("" for a tensor) for the opaque
        op: dynamo folds string ops on constants, not json; letters are single characters
        and layout codes hold no ";" or "/"."""
        fields = [
            ",".join(self.inputs),
            self.rhs,
            "/".join(layouts),
            ",".join("".join(symbols) for symbols in self.symbols_of),
            ",".join(str(n) for n in self.batched_dense),
            "".join(self.out_symbols),
            self.out_layout.code,
        ]
        return ";".join(fields)

    @staticmethod
    def decode(meta: str) -> tuple[_Spec, list[str]]:
        fields = meta.split(";")
        spec = _Spec(
            fields[0].split(","),
            fields[1],
            [list(symbols) for symbols in fields[3].split(",")],
            [int(n) for n in fields[4].split(",") if n],
            list(fields[5]),
            Layout(fields[6]),
        )
        return spec, fields[2].split("/")


def einsum(equation: str, *operands: Ragged | Tensor) -> Ragged | Tensor:
    """Per-sample ``torch.einsum`` over ``Ragged`` and dense operands.

    Each ``Ragged`` operand's subscripts name its logical axes, the batch axis
    first; the first letter is the batch letter, shared by every ``Ragged``
    operand and the output. A dense operand whose subscripts contain the batch
    letter (first) is a batched ``[B, ...]`` tensor; otherwise it is shared by
    all samples (a weight). A letter on a ragged axis must be ragged wherever it
    appears, with the same size in each sample. Output letters that are ragged
    become ragged axes of the result; with none, the result is a dense
    ``[B, ...]`` tensor. Ellipsis is not supported.

    Nested operands (documents -> sentences -> tokens) multiply per element of
    their outer ragged axes: axes that lead every ``Ragged`` operand and the
    output under the same letters (same partitions) are a batch, and below them
    each operand's ragged axes must be one rectangle:
    ``einsum('bstd,bsud->bstu', docs, docs)`` is a pair state ``(B, S*, L*, L*)``
    per sentence (layout ``r0 n1 r2``), ``einsum('bstu,bsud->bstd', p, docs)``
    contracts it back. Other products of nested axes (contracting an outer axis,
    a batched dense operand) raise ``RaggedError``.

    Args:
        equation: e.g. ``'bikc,bjkc->bijc'`` (triangle update, outgoing),
            ``'bkic,bkjc->bijc'`` (incoming), ``'bnd,bmd->bnm'`` (scores),
            ``'bnd,de->bne'`` (a weight).
        operands: ``Ragged`` values and tensors.

    Returns:
        ``Ragged`` with layout ragged axes numbered in output order, or a dense
        tensor when no output axis is ragged.

    Raises:
        RaggedError: subscripts that do not match the operands' logical ranks; a ``Ragged``
            operand whose first subscript is not the batch letter, or with another batch
            size; a letter ragged in one operand and dense in another; an output that does
            not start with the batch letter; forward-mode AD inside ``torch.compile`` through
            a product that contracts a ragged axis or combines two ``Ragged`` operands (one
            opaque node there, see docs/transforms.md).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.randn(2, 3), torch.randn(4, 3)])
        >>> s = raggedfn.einsum('bnd,bmd->bnm', x, x)
        >>> s.shape, s.sizes.tolist()
        ((2, None, None), [[2, 2], [4, 4]])
    """
    fn = "einsum"
    inputs, rhs = _parse(fn, equation, len(operands))
    if not any(isinstance(op, Ragged) for op in operands):
        return torch.einsum(equation, *operands)
    batch_letter = ""
    ragged_letters: set[str] = set()
    dense_letters: set[str] = set()
    symbols_of: list[list[str]] = []
    batch_size = -1
    for n, (op, sub) in enumerate(zip(operands, inputs, strict=True)):
        if isinstance(op, Ragged):
            if len(sub) != op.ndim:
                raise fail(
                    fn,
                    f"operand {n} has {op.ndim} logical axes (shape {shape_text(op.shape)}) but subscripts "
                    f"{sub!r}",
                )
            batch_letter = batch_letter or sub[0]
            if sub[0] != batch_letter:
                raise fail(
                    fn,
                    f"operand {n}: a Ragged operand's first subscript is the batch letter "
                    f"{batch_letter!r}, got {sub!r}",
                )
            if batch_size >= 0 and op.batch_size != batch_size:
                raise fail(fn, f"operand {n} has {op.batch_size} samples, expected {batch_size}")
            batch_size = op.batch_size
            symbols = [""] * op.num_ragged
            for p, axis in enumerate(op.layout.axes):
                letter = sub[1 + p]
                if axis.ragged:
                    symbols[axis.index] = letter
                    ragged_letters.add(letter)
                else:
                    dense_letters.add(letter)
            symbols_of.append(symbols)
        elif isinstance(op, Tensor):
            if len(sub) != op.ndim:
                raise fail(
                    fn,
                    f"operand {n} is {describe(op)} but has subscripts {sub!r} ({len(sub)} axes)",
                )
            dense_letters.update(sub)
            symbols_of.append([])
        else:
            raise fail(fn, f"operand {n} must be a Ragged value or a tensor, got {describe(op)}")
    dense_letters.discard(batch_letter)
    mixed = sorted(ragged_letters & dense_letters)
    if mixed:
        raise fail(fn, f"letters {mixed} are ragged in one operand and dense in another")
    for n, (op, sub) in enumerate(zip(operands, inputs, strict=True)):
        if isinstance(op, Tensor) and batch_letter in sub:
            if sub[0] != batch_letter or op.shape[0] != batch_size:
                raise fail(
                    fn,
                    f"operand {n} ({describe(op)}) uses the batch letter {batch_letter!r}: it must "
                    f"come first and have size B = {batch_size}",
                )
    if not rhs or rhs[0] != batch_letter:
        raise fail(fn, f"the output {rhs!r} must start with the batch letter {batch_letter!r}")
    out_positions = tuple(p for p, c in enumerate(rhs[1:]) if c in ragged_letters)
    out_symbols = [rhs[1 + p] for p in out_positions]
    out_layout = Layout.from_ragged_positions(len(rhs) - 1, out_positions)

    raggeds = [n for n, op in enumerate(operands) if isinstance(op, Ragged)]
    batched_dense = [
        n for n, op in enumerate(operands) if isinstance(op, Tensor) and batch_letter in inputs[n]
    ]
    if len(raggeds) == 1 and not batched_dense and out_symbols:
        n = raggeds[0]
        x = operands[n]
        assert isinstance(x, Ragged)
        if out_symbols == symbols_of[n]:
            if x.row_offsets:  # the nested levels ride along too
                letters = tuple(a.nested for a in x.layout.axes if a.ragged)
                out_layout = Layout.from_ragged_positions(len(rhs) - 1, out_positions, letters)
            return _packed(equation, operands, inputs, rhs, n, out_layout)
    if any(isinstance(op, Ragged) and op.row_offsets for op in operands):
        return per_element_einsum(fn, inputs, rhs, operands, batched_dense, einsum)
    for op in operands:
        if isinstance(op, Ragged):
            refuse_nested(fn, op, "products that combine or contract nested ragged axes")

    spec = _Spec(inputs, rhs, symbols_of, batched_dense, out_symbols, out_layout)
    if torch.compiler.is_compiling():  # the bucket plan runs inside one opaque graph node
        return _compiled(spec, operands)
    return _bucketed(spec, operands)


@torch.compiler.disable  # reads sizes on the host; under compile einsum calls _compiled instead
def _bucketed(spec: _Spec, operands: tuple[Ragged | Tensor, ...]) -> Ragged | Tensor:
    """Per-sample einsum, one batched dense einsum per length bucket."""
    fn = "einsum"
    inputs, rhs, symbols_of, batched_dense, out_symbols, out_layout = spec
    ragged_sizes: dict[str, list[int]] = {}
    batch_size = 0
    for n, op in enumerate(operands):
        if not isinstance(op, Ragged):
            continue
        batch_size = op.batch_size
        columns = _bucket.ragged_sizes(op)
        for k, letter in enumerate(symbols_of[n]):
            known = ragged_sizes.setdefault(letter, columns[k])
            if known != columns[k]:
                raise fail(
                    fn,
                    f"ragged axis {letter!r} has sizes {known} in one operand and "
                    f"{columns[k]} in operand {n}",
                )
    if batch_size > 0 and (
        batch_size <= PER_SAMPLE_MAX_BATCH
        or _mean_work(spec, operands, ragged_sizes, batch_size) >= PER_SAMPLE_MIN_WORK
    ):
        return _per_sample(spec, operands, ragged_sizes, batch_size)
    buckets = _bucket.plan(ragged_sizes, batch_size)
    per_operand: list[list[Any]] = []
    for n, op in enumerate(operands):
        if isinstance(op, Ragged):
            per_operand.append(_bucket.pad(op, symbols_of[n], buckets))
        elif n in batched_dense:
            per_operand.append(_bucket.pad_dense(op, buckets))
        else:
            per_operand.append([op] * len(buckets))
    text = ",".join(inputs) + "->" + rhs
    parts = [torch.einsum(text, *args) for args in zip(*per_operand, strict=True)]
    if not out_symbols:
        return _bucket.unpad_dense(parts, buckets, batch_size)
    return _bucket.unpad(parts, out_layout, out_symbols, buckets, ragged_sizes, batch_size)


# One einsum per sample on views beats padded buckets for very small batches, or once a
# sample's work (the product of all its axis sizes) averages this much; measured on CPU,
# 1 thread, triangle update fwd+bwd: views/buckets 0.77 at B = 4 (any size), 1.2-3.3 at
# B = 8-64 with mean work 3e4-1.3e5, 0.95 at 8.7e5 and 0.76-0.78 at 1.5e6-1.7e6.
PER_SAMPLE_MAX_BATCH = 4
PER_SAMPLE_MIN_WORK: float = 600_000


def _mean_work(
    spec: _Spec, operands: tuple[Ragged | Tensor, ...], sizes: dict[str, list[int]], batch: int
) -> float:
    """Mean over samples of the product of every axis size of the einsum."""
    dense: dict[str, int] = {}
    for op, sub in zip(operands, spec.inputs, strict=True):
        if isinstance(op, Ragged):
            for p, axis in enumerate(op.layout.axes):
                if not axis.ragged:
                    dense[sub[1 + p]] = op.values.shape[1 + axis.index]
        else:
            dense.update(zip(sub, op.shape, strict=True))
    batch_letter = spec.rhs[0]
    per_sample = math.prod(
        size for letter, size in dense.items() if letter not in sizes and letter != batch_letter
    )
    ragged = [math.prod(column[b] for column in sizes.values()) for b in range(batch)]
    return per_sample * sum(ragged) / batch


def _per_sample(
    spec: _Spec,
    operands: tuple[Ragged | Tensor, ...],
    sizes: dict[str, list[int]],
    batch_size: int,
) -> Ragged | Tensor:
    """One dense einsum per sample on views of the packed values (no padding, no gather):
    a sample's rows are contiguous, so each operand is a reshape and a permute; the
    results are joined by one ``cat`` (its backward is one ``split``)."""
    inputs, rhs, symbols_of, batched_dense, out_symbols, out_layout = spec
    per_operand: list[Any] = []
    subs = []
    for n, (op, sub) in enumerate(zip(operands, inputs, strict=True)):
        if isinstance(op, Ragged):
            own = [[sizes[s][b] for s in symbols_of[n]] for b in range(batch_size)]
            per_operand.append(_bucket.sample_views(op, own))
            subs.append(sub[1:])
        elif n in batched_dense:
            per_operand.append(op.unbind(0))
            subs.append(sub[1:])
        else:
            per_operand.append([op] * batch_size)
            subs.append(sub)
    text = ",".join(subs) + "->" + rhs[1:]
    results = [torch.einsum(text, *args) for args in zip(*per_operand, strict=True)]
    if not out_symbols:
        return torch.stack(results)
    order = out_layout.logical_to_physical()
    pieces = []
    for result in results:
        physical = result.permute(order)
        pieces.append(physical.flatten(0, len(out_symbols) - 1))
    out_sizes = torch.tensor(
        [[sizes[s][b] for s in out_symbols] for b in range(batch_size)],
        dtype=torch.int64,
        device=pieces[0].device,
    )
    return Ragged(torch.cat(pieces), offsets_of(out_sizes.prod(dim=1)), out_sizes, out_layout)


def _compiled(spec: _Spec, operands: tuple[Ragged | Tensor, ...]) -> Ragged | Tensor:
    """:func:`_bucketed` under ``torch.compile``: one opaque node (``_prims.host_planned``).

    The result's partition is built in the graph from the operands' sizes; its
    row count is data-dependent unless an operand has the result's partition.
    """
    inputs, rhs, symbols_of, _, out_symbols, out_layout = spec
    tensors: list[Tensor] = []
    layouts: list[str] = []
    letter_size: dict[str, Any] = {}
    columns: dict[str, Tensor] = {}
    reuse: Ragged | None = None  # an operand whose partition is the result's
    batch_size = 0
    for n, (op, sub) in enumerate(zip(operands, inputs, strict=True)):
        if isinstance(op, Ragged):
            tensors += [op.values, op.offsets, op.sizes]
            layouts.append(op.layout.code)
            batch_size = op.batch_size
            for p, axis in enumerate(op.layout.axes):
                if not axis.ragged:
                    letter_size.setdefault(sub[1 + p], op.values.shape[1 + axis.index])
            for k, letter in enumerate(symbols_of[n]):
                columns.setdefault(letter, op.sizes[:, k])
            if reuse is None and symbols_of[n] == out_symbols:
                reuse = op
        else:
            tensors.append(op)
            layouts.append("")
            for letter, size in zip(sub, op.shape, strict=True):
                letter_size.setdefault(letter, size)
    meta = spec.encode(layouts)
    if not out_symbols:
        shape = [batch_size, *(letter_size[c] for c in rhs[1:])]
        return _prims.host_planned("einsum", meta, tensors, shape)
    if reuse is not None:
        offsets, sizes, total = reuse.offsets, reuse.sizes, reuse.values.shape[0]
    else:
        sizes = torch.stack([columns[s] for s in out_symbols], dim=1)
        offsets = offsets_of(sizes.prod(dim=1))
        total = int(offsets[-1])  # a new packed row count: data-dependent
    dense = {a.index: rhs[1 + p] for p, a in enumerate(out_layout.axes) if not a.ragged}
    shape = [total, *(letter_size[dense[j]] for j in range(out_layout.num_dense))]
    values = _prims.host_planned("einsum", meta, tensors, shape)
    return Ragged(values, offsets, sizes, out_layout)


@_prims.implement("einsum")
def _compiled_impl(tensors: Sequence[Tensor], meta: str) -> Tensor:
    """The eager :func:`_bucketed` on the flattened operands of :func:`_compiled`."""
    spec, layouts = _Spec.decode(meta)
    found = iter(tensors)
    operands: list[Ragged | Tensor] = []
    for code in layouts:
        if code:
            operands.append(Ragged(next(found), next(found), next(found), Layout(code)))
        else:
            operands.append(next(found))
    out = _bucketed(spec, tuple(operands))
    return out.values if isinstance(out, Ragged) else out


def _packed(
    equation: str,
    operands: tuple[Ragged | Tensor, ...],
    inputs: list[str],
    rhs: str,
    n: int,
    out_layout: Layout,
) -> Ragged:
    """One einsum on packed values: the ragged axes of operand ``n`` only ride along."""
    x = operands[n]
    assert isinstance(x, Ragged)
    used = set(equation)
    packed_letter = next(c for c in _LETTERS if c not in used)
    dense_by_index = {
        a.index: inputs[n][1 + p] for p, a in enumerate(x.layout.axes) if not a.ragged
    }
    x_sub = packed_letter + "".join(dense_by_index[j] for j in range(x.layout.num_dense))
    out_dense = {a.index: rhs[1 + p] for p, a in enumerate(out_layout.axes) if not a.ragged}
    out_sub = packed_letter + "".join(out_dense[j] for j in range(out_layout.num_dense))
    subs = [x_sub if m == n else s for m, s in enumerate(inputs)]
    args = [x.values if m == n else op for m, op in enumerate(operands)]
    values = torch.einsum(",".join(subs) + "->" + out_sub, *args)
    return like(x, values, out_layout)
