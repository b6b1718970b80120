"""The ``Ragged`` value: packed values, partitions and a static dim order."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._errors import RaggedError, describe, fail, shape_text
from ._index import gather_ranges, lengths_of, offsets_of
from ._layout import Axis, Layout
from ._mixed import rectangle_sides
from ._nested import level_offsets
from ._validate import check_partition, check_structure

OPTREE_NAMESPACE = "raggedfn"
_FIELDS = ("values", "offsets", "sizes", "layout", "row_offsets")


@dataclass(frozen=True, eq=False)
class Ragged:
    """A batch of variable-size samples as one immutable value.

    Args:
        values: ``[T, *dense]`` every sample's ragged axes flattened row-major into
            the leading axis; dense axes trail.
        offsets: int64 ``[B + 1]``; sample ``i`` owns ``values[offsets[i]:offsets[i+1]]``.
        sizes: int64 ``[B, R]``; sample ``i``'s size along each ragged axis (for a
            nested axis: the number of its elements in sample ``i``).
        layout: the logical order of a sample's axes (see :class:`Layout`).
        row_offsets: one int64 ``[N + 1]`` tensor per nested axis ``k`` (``k >= 1``):
            element ``e`` of ragged axis ``k - 1`` (numbered across the batch) owns
            elements ``row_offsets[k - 1][e] : row_offsets[k - 1][e + 1]`` of axis
            ``k``; the innermost axis's elements are the packed rows. Empty (the
            default) for values without nested axes.

    Build values with the constructors (``from_list``, ``from_lengths``, ...),
    which validate user data. The dataclass constructor runs only cheap
    structural checks.

    Raises:
        RaggedError: the dataclass constructor gets a ``layout`` that is not a ``Layout``,
            non-tensor parts, ``offsets``/``sizes`` that are not int64 ``[B + 1]``/``[B,
            R]``, ``values`` without a packed axis or with another number of dense axes than
            the layout declares, or parts on different devices; ``lengths`` of a value with
            several ragged axes; ``with_values`` with another number of packed rows;
            indexing with anything but an int, a slice, a list or a 1-D int/bool tensor of
            samples; ``bool(x)``.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> x.shape, x.batch_size, x.lengths.tolist()
        ((2, None, 3), 2, [2, 4])
    """

    values: Tensor
    offsets: Tensor
    sizes: Tensor
    layout: Layout
    row_offsets: tuple[Tensor, ...] = ()

    def __post_init__(self) -> None:
        check_structure(
            "Ragged", self.values, self.offsets, self.sizes, self.layout, self.row_offsets
        )

    @classmethod
    def _make(
        cls, values: Any, offsets: Any, sizes: Any, layout: Layout, row_offsets: Any = ()
    ) -> Ragged:
        """Build without any check (pytree unflatten may pass non-tensor leaves)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "values", values)
        object.__setattr__(obj, "offsets", offsets)
        object.__setattr__(obj, "sizes", sizes)
        object.__setattr__(obj, "layout", layout)
        object.__setattr__(obj, "row_offsets", row_offsets)
        return obj

    def __copy__(self) -> Ragged:
        """The value itself: it is immutable (and a copy must not re-validate)."""
        return self

    def __setstate__(self, state: Any) -> None:
        """Unpickling (``torch.load``, ``pickle``, ``copy.deepcopy``, worker queues).

        The data comes from outside this process, so every invariant is checked,
        the partition data too (a host sync).
        """
        fn = "Ragged.__setstate__"
        if isinstance(state, dict) and set(state) == set(_FIELDS[:4]):
            state = {**state, "row_offsets": ()}  # saved before nested axes existed
        if not isinstance(state, dict) or set(state) != set(_FIELDS):
            raise fail(fn, f"expected a dict with keys {_FIELDS}, got {describe(state)}")
        values, offsets, sizes, layout, row_offsets = (state[name] for name in _FIELDS)
        check_structure(fn, values, offsets, sizes, layout, row_offsets)
        check_partition(fn, values, offsets, sizes, row_offsets, layout)
        for name in _FIELDS:
            object.__setattr__(self, name, state[name])

    # ----- attributes -------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Number of samples ``B``."""
        return self.offsets.shape[0] - 1

    @property
    def num_ragged(self) -> int:
        """Number of ragged axes ``R`` of a sample."""
        return self.layout.num_ragged

    @property
    def is_nested(self) -> bool:
        """Whether the ragged axes are nested levels (documents of sentences of tokens)."""
        return bool(self.row_offsets)

    @property
    def lengths(self) -> Tensor:
        """``[B]`` length of each sample; only for one ragged axis."""
        if self.layout.num_ragged != 1:
            raise fail(
                "lengths",
                f"a value with {self.layout.num_ragged} ragged axes has no single length per "
                "sample; use sizes ([B, R]) instead",
            )
        return self.sizes[:, 0]

    @property
    def shape(self) -> tuple[int | None, ...]:
        """Logical shape ``(B, ...)`` with ``None`` for each ragged axis."""
        dense = self.values.shape[1:]
        return (self.batch_size, *(None if a.ragged else dense[a.index] for a in self.layout.axes))

    @property
    def ndim(self) -> int:
        """Logical rank, counting the batch axis."""
        return 1 + self.layout.rank

    def dim(self) -> int:
        """Logical rank, like ``Tensor.dim()``."""
        return self.ndim

    @property
    def ragged_dims(self) -> tuple[int, ...]:
        """The logical axes (batch = 0) that are ragged, ascending."""
        return tuple(1 + p for p, a in enumerate(self.layout.axes) if a.ragged)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of ``values``."""
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``values`` (``offsets`` and ``sizes`` live there too)."""
        return self.values.device

    @property
    def requires_grad(self) -> bool:
        """Whether ``values`` requires grad."""
        return self.values.requires_grad

    def __len__(self) -> int:
        return int(self.batch_size)

    # ----- new values -------------------------------------------------------
    def with_values(self, values: Tensor) -> Ragged:
        """The same partitions with new packed ``values`` (same leading size)."""
        if not isinstance(values, Tensor):
            raise fail("with_values", f"values must be a tensor, got {describe(values)}")
        if values.ndim < 1 or values.shape[0] != self.values.shape[0]:
            raise fail(
                "with_values",
                f"values must have {self.values.shape[0]} packed rows, got shape {shape_text(values.shape)}",
            )
        layout = self.layout
        if values.ndim != self.values.ndim:
            num_ragged, nested = layout.num_ragged, layout.num_nested > 0
            ragged = layout.axes[:num_ragged]
            if layout != Layout.standard(num_ragged, layout.num_dense, nested) and (
                [a.index if a.ragged else -1 for a in ragged] != list(range(num_ragged))
            ):
                raise fail(
                    "with_values",
                    f"values of shape {shape_text(values.shape)} change the dense axes of a value whose "
                    f"layout {layout.describe(tuple(self.values.shape[1:]))} is not ragged-axes-first; "
                    "permute it to that order first",
                )
            standard = Layout.standard(num_ragged, values.ndim - 1, nested)
            if standard.axes[:num_ragged] == ragged:
                layout = standard
            else:  # rectangular ragged axes among nested ones keep their letters
                layout = Layout(ragged + standard.axes[num_ragged:])
        if values.device != self.values.device:  # check_structure names the devices
            return Ragged(values, self.offsets, self.sizes, layout, self.row_offsets)
        # x's own partition (checked when x was built), values with its packed rows on its
        # device, and a layout with their dense axes: nothing for check_structure to find
        return Ragged._make(values, self.offsets, self.sizes, layout, self.row_offsets)

    def clone(self) -> Ragged:
        """A copy that owns new ``values`` (and partition) tensors, like ``Tensor.clone``.

        Gradients flow through the copy of ``values`` as through ``Tensor.clone``.
        """
        return Ragged(
            self.values.clone(),
            self.offsets.clone(),
            self.sizes.clone(),
            self.layout,
            tuple(p.clone() for p in self.row_offsets),
        )

    def detach(self) -> Ragged:
        """The same value with ``values`` detached from the autograd graph."""
        return like(self, self.values.detach())

    def double(self) -> Ragged:
        """``values`` as float64."""
        return self.to(torch.float64)

    def float(self) -> Ragged:
        """``values`` as float32."""
        return self.to(torch.float32)

    # ----- devices: every tensor of the value moves, with the same flags ------
    def to(self, *args: Any, **kwargs: Any) -> Ragged:
        """Like ``Tensor.to``: a dtype applies to ``values``; the device, ``non_blocking``
        and ``copy`` apply to ``values``, ``offsets`` and ``sizes`` alike.

        Takes every form of ``Tensor.to`` (``to(device, dtype, non_blocking=...)``,
        ``to(dtype)``, ``to(other)``); ``other`` may also be a ``Ragged``.

        Example:
            >>> import torch, raggedfn
            >>> x = raggedfn.from_list([torch.ones(2), torch.ones(3)])
            >>> y = x.to("cpu", torch.float64, non_blocking=True)
            >>> y.dtype, y.offsets.dtype, y.device
            (torch.float64, torch.int64, device(type='cpu'))
        """
        if args and isinstance(args[0], Ragged):
            args = (args[0].values, *args[1:])
        values = self.values.to(*args, **kwargs)
        # Tensor.to's positional flags are the bools after the device/dtype/other:
        # the first is non_blocking, the second copy
        flags = [a for a in args if isinstance(a, bool)]
        non_blocking = bool(kwargs.get("non_blocking", flags[0] if flags else False))
        copy = bool(kwargs.get("copy", flags[1] if len(flags) > 1 else False))
        return self._partitions_to(values, non_blocking, copy)

    def cuda(self, device: Any = None, non_blocking: bool = False) -> Ragged:
        """Like ``Tensor.cuda``: every tensor of the value to a CUDA device."""
        values = self.values.cuda(device, non_blocking=non_blocking)
        return self._partitions_to(values, non_blocking, False)

    def cpu(self) -> Ragged:
        """Like ``Tensor.cpu``: every tensor of the value to host memory."""
        return self.to("cpu")

    def pin_memory(self) -> Ragged:
        """Like ``Tensor.pin_memory``: every tensor copied to page-locked host memory,
        so that ``to(device, non_blocking=True)`` overlaps the copy with compute.

        The DataLoader's pin-memory thread calls this (also inside dicts, lists and
        tuples). Without an accelerator torch cannot pin and raises ``RuntimeError``,
        as ``Tensor.pin_memory`` does.
        """
        return Ragged(
            self.values.pin_memory(),
            self.offsets.pin_memory(),
            self.sizes.pin_memory(),
            self.layout,
            tuple(p.pin_memory() for p in self.row_offsets),
        )

    def is_pinned(self) -> bool:
        """Whether ``values``, ``offsets``, ``sizes`` (and ``row_offsets``) are all pinned."""
        tensors = (self.values, self.offsets, self.sizes, *self.row_offsets)
        return all(t.is_pinned() for t in tensors)

    def _partitions_to(self, values: Tensor, non_blocking: bool, copy: bool) -> Ragged:
        device = values.device
        offsets = self.offsets.to(device, non_blocking=non_blocking, copy=copy)
        sizes = self.sizes.to(device, non_blocking=non_blocking, copy=copy)
        row_offsets = tuple(
            p.to(device, non_blocking=non_blocking, copy=copy) for p in self.row_offsets
        )
        return Ragged(values, offsets, sizes, self.layout, row_offsets)

    # ----- indexing ---------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        """``x[i]`` is sample ``i`` (a tensor in logical axis order; for nested axes a
        ``Ragged`` with one level less); ``x[i:j]``, ``x[int tensor]``, ``x[bool tensor]``
        and ``x[list]`` are sub-batches."""
        fn = "Ragged.__getitem__"
        if isinstance(index, (int, torch.SymInt)) and not isinstance(index, bool):
            return _sample(self, index)
        if (
            isinstance(index, Tensor)
            and index.ndim == 0
            and not index.is_floating_point()
            and not index.is_complex()
            and index.dtype != torch.bool
        ):
            return _sample(self, int(index))
        if isinstance(index, tuple):
            # x[i, j] would mean "element j of sample i" for a tensor: refuse, never guess
            raise fail(
                fn,
                f"multi-axis indexing {index!r} is not supported; index a sample first "
                "(x[i][...]) or pass a list of samples (x[[i, j]])",
            )
        if not isinstance(index, (Tensor, slice, list, bool)) and hasattr(index, "__index__"):
            return _sample(self, operator.index(index))  # numpy integers
        if isinstance(index, slice):
            index = torch.tensor(range(self.batch_size)[index], dtype=torch.int64)
        if isinstance(index, list):
            if not all(isinstance(i, (bool, int)) or hasattr(i, "__index__") for i in index) or (
                0 < sum(isinstance(i, bool) for i in index) < len(index)
            ):
                raise fail(
                    fn, f"a list index must hold only ints or only bools, got {describe(index)}"
                )
            index = torch.as_tensor(index) if index else torch.zeros(0, dtype=torch.int64)
        if isinstance(index, Tensor):
            return _select_samples(self, index.to(self.offsets.device))
        raise fail(
            fn,
            f"index must be an int, a slice, a list or a 1-D int/bool tensor of samples, got {describe(index)}",
        )

    def __iter__(self) -> Any:
        """The samples, as ``x[0], x[1], ...`` (host sync per sample)."""
        return iter([self[i] for i in range(len(self))])

    def __repr__(self) -> str:
        try:
            shape = (
                f"(B={self.batch_size}, {self.layout.describe(tuple(self.values.shape[1:]))[1:]}"
            )
            head = self.sizes[:4]
            shown = head[:, 0].tolist() if self.num_ragged == 1 else head.tolist()
            more = ", ..." if self.batch_size > 4 else ""
            text = str(shown)[:-1] + more + "]" if shown else "[]"
            label = "lengths" if self.num_ragged == 1 else "sizes"
        except Exception:  # symbolic or batched leaves: fall back to structure only
            return f"Ragged(layout={self.layout}, values={type(self.values).__name__})"
        return f"Ragged(shape={shape}, dtype={self.dtype}, device={self.device}, {label}={text})"

    # Operators (+, @, ==, ...) are bound onto the class by ``raggedfn.ops`` (the value
    # does not import the op layer); declared here for type checkers only.
    __hash__ = object.__hash__

    if TYPE_CHECKING:

        def __add__(self, other: Any) -> Any: ...
        def __radd__(self, other: Any) -> Any: ...
        def __sub__(self, other: Any) -> Any: ...
        def __rsub__(self, other: Any) -> Any: ...
        def __mul__(self, other: Any) -> Any: ...
        def __rmul__(self, other: Any) -> Any: ...
        def __truediv__(self, other: Any) -> Any: ...
        def __rtruediv__(self, other: Any) -> Any: ...
        def __floordiv__(self, other: Any) -> Any: ...
        def __rfloordiv__(self, other: Any) -> Any: ...
        def __pow__(self, other: Any) -> Any: ...
        def __rpow__(self, other: Any) -> Any: ...
        def __neg__(self) -> Any: ...
        def __abs__(self) -> Any: ...
        def __eq__(self, other: Any) -> Any: ...  # type: ignore[override]
        def __ne__(self, other: Any) -> Any: ...  # type: ignore[override]
        def __lt__(self, other: Any) -> Any: ...
        def __le__(self, other: Any) -> Any: ...
        def __gt__(self, other: Any) -> Any: ...
        def __ge__(self, other: Any) -> Any: ...
        def __matmul__(self, other: Any) -> Any: ...
        def __rmatmul__(self, other: Any) -> Any: ...

    def __bool__(self) -> bool:
        raise fail("Ragged.__bool__", "the truth value of a Ragged value is ambiguous")


def as_rectangular(values: Tensor, offsets: Tensor, counts: Tensor, layout: Layout) -> Ragged:
    """A ``Ragged`` with rectangular ragged axes only, from a chain partition whose
    layout has no nested axis left (``counts``: the chain's per-sample element counts)."""
    assert not layout.num_nested, layout
    return Ragged(values, offsets, rectangle_sides(counts), layout)


def like(x: Ragged, values: Tensor, layout: Layout | None = None) -> Ragged:
    """A value with the partitions of ``x`` (nested ones too) and new ``values``/``layout``."""
    return Ragged(values, x.offsets, x.sizes, x.layout if layout is None else layout, x.row_offsets)


def _sample(x: Ragged, index: int | torch.SymInt) -> Any:
    batch_size = x.batch_size
    if not -batch_size <= index < batch_size:
        raise fail(
            "Ragged.__getitem__", f"sample {index} is out of range for a batch of {batch_size}"
        )
    index = index % batch_size
    if x.row_offsets:
        return inner_sample(x, index)
    start, stop = x.offsets[index : index + 2].tolist()
    sample_sizes = x.sizes[index].tolist()
    physical = x.values[start:stop].reshape(*sample_sizes, *x.values.shape[1:])
    return physical.permute(x.layout.physical_to_logical())


def _select_samples(x: Ragged, index: Tensor) -> Ragged:
    fn = "Ragged.__getitem__"
    if index.ndim != 1:
        raise fail(fn, f"a sample index tensor must be 1-D, got {describe(index)}")
    if index.dtype == torch.bool:
        if index.shape[0] != x.batch_size:
            raise fail(
                fn, f"a boolean sample mask must have {x.batch_size} entries, got {describe(index)}"
            )
        index = index.nonzero().squeeze(1)
    elif index.is_floating_point() or index.is_complex():
        raise fail(fn, f"a sample index tensor must be int or bool, got {describe(index)}")
    index = index.to(device=x.offsets.device, dtype=torch.int64)
    batch_size = x.batch_size
    if index.numel() and bool(((index < -batch_size) | (index >= batch_size)).any()):
        raise fail(
            fn, f"sample indices {index.tolist()} are out of range for a batch of {batch_size}"
        )
    index = torch.remainder(index, max(batch_size, 1))
    if x.row_offsets:
        return _select_nested(x, index)
    source, offsets = gather_ranges(x.offsets[index], lengths_of(x.offsets)[index])
    return Ragged(x.values[source], offsets, x.sizes[index], x.layout)


def _select_nested(x: Ragged, index: Tensor) -> Ragged:
    """Samples ``index`` of a nested value: each level's element ranges, gathered."""
    levels = level_offsets(x.sizes, x.row_offsets)
    starts = [level[index] for level in levels]
    counts = [lengths_of(level)[index] for level in levels]
    sources = [gather_ranges(s, c)[0] for s, c in zip(starts, counts, strict=True)]
    row_offsets = tuple(
        offsets_of(lengths_of(parts).index_select(0, source))
        for parts, source in zip(x.row_offsets, sources, strict=False)
    )
    return Ragged(
        x.values[sources[-1]], offsets_of(counts[-1]), x.sizes[index], x.layout, row_offsets
    )


def inner_sample(x: Ragged, index: int | torch.SymInt) -> Ragged:
    """Sample ``index`` of a nested value as a ``Ragged`` with one level less: its
    elements along the outermost ragged axis are the samples."""
    fn = "Ragged.__getitem__"
    axes = x.layout.axes
    if not axes[0].ragged:
        raise fail(
            fn,
            "a sample of a nested value is a Ragged whose batch axis is the outermost ragged "
            f"axis, which must come first; got logical shape {x.layout.describe(tuple(x.values.shape[1:]))}",
        )
    levels = level_offsets(x.sizes, x.row_offsets)
    bounds = torch.stack([level[index : index + 2] for level in levels]).tolist()
    (first, last), (start, stop) = bounds[0], bounds[-1]
    parts = x.row_offsets
    # offsets of each inner level per element of the outer level, composed down
    composed = [torch.arange(first, last + 1, device=x.offsets.device)]
    for p in parts:
        composed.append(p.index_select(0, composed[-1]))
    offsets = composed[-1] - start
    sizes = torch.stack([lengths_of(c) for c in composed[1:]], 1)
    row_offsets = tuple(
        p[lo : hi + 1] - p[lo] for p, (lo, hi) in zip(parts[1:], bounds[1:-1], strict=True)
    )
    # the outermost axis becomes the batch; the axes after it keep their letters
    layout = Layout(
        tuple(
            Axis(True, a.index - 1, a.index > 1 and a.nested) if a.ragged else a for a in axes[1:]
        )
    )
    if layout.num_ragged > 1 and not layout.num_nested:  # one rectangle per element
        return as_rectangular(x.values[start:stop], offsets, sizes, layout)
    return Ragged(x.values[start:stop], offsets, sizes, layout, row_offsets)


__all__ = ["OPTREE_NAMESPACE", "Ragged", "RaggedError"]
