"""Stand-in samples for ``map`` over a nested value: ``f`` runs once on them and every
op it applies is recorded, computed on two small example samples of different sizes
(so that ``f`` sees real types and shapes, and a size that differs between them is
known to follow the sample).

- ``SampleStandIn``: a one-level ``Ragged`` (a document's sentences of tokens). Public
  raggedfn ops and operators given one are recorded as *batch* nodes (run later by the
  same op one level deeper on the nested batch).
- ``DenseStandIn``: a ``torch.Tensor`` (a per-sample dense result). Torch functions and
  raggedfn ops given only these are recorded as *sample* nodes (run later by a
  one-level ``map`` over the batch).

Anything the record cannot stand for (reading a sample's sizes or data, writes, an op
without an axis rule) raises ``NotRecordable`` with the reason; ``map`` then runs the
per-sample loop and says why.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ... import _dispatch
from ..._errors import fail
from ..._ragged import Ragged
from . import _memo


class NotRecordable(BaseException):
    """``f`` did something a record cannot stand for (a BaseException: ``f``'s own
    ``except Exception`` must not swallow it)."""


@dataclasses.dataclass(frozen=True, order=True)
class Ref:
    """A recorded value, by number (a pytree leaf, unlike a NamedTuple)."""

    id: int


def tree_map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` on the leaves of nested tuples, lists and dicts (the arguments of an op;
    torch's pytree would also open ``Ragged`` values and NamedTuples, and costs more)."""
    kind = type(value)
    if kind is tuple or kind is list:
        return kind([tree_map(fn, v) if type(v) in _CONTAINERS else fn(v) for v in value])
    if kind is dict:
        return {k: tree_map(fn, v) if type(v) in _CONTAINERS else fn(v) for k, v in value.items()}
    return fn(value)


_CONTAINERS = (tuple, list, dict)


def tree_leaves(value: Any) -> list[Any]:
    out: list[Any] = []
    tree_map(out.append, value)
    return out


def is_leaf(value: Any) -> bool:
    """Pytree leaves of records: ``Ragged`` values are kept whole."""
    return isinstance(value, (Ragged, Ref))


class Node(NamedTuple):
    kind: str  # "batch" or "sample"
    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any  # a pytree of Ref (and constants)


class Recorder:
    """The ops recorded in one run of ``f`` on stand-ins."""

    def __init__(self, previous: list[tuple[Any, Any]] | None = None) -> None:
        self.nodes: list[Node] = []
        self.count = 0
        self.failure: str | None = None
        self.previous = previous  # the last record's example results (_memo.py)
        self.memo: list[tuple[Any, Any]] = []

    def new_ref(self) -> Ref:
        self.count += 1
        return Ref(self.count - 1)

    def fail(self, reason: str) -> NoReturn:
        if self.failure is None:
            self.failure = reason
        raise NotRecordable(reason)


_LOCAL = threading.local()


def recorder() -> Recorder:
    found: Recorder | None = getattr(_LOCAL, "recorder", None)
    if found is None:  # a stand-in escaped its recording (kept by f and used later)
        raise fail("map", "a stand-in sample of a map over a nested value was used after the map")
    return found


class recording:
    """Make ``rec`` the current recorder and let public ops see stand-ins."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def __enter__(self) -> Recorder:
        self.saved = getattr(_LOCAL, "recorder", None)
        _LOCAL.recorder = self.rec
        _dispatch.ACTIVE[0] += 1
        self.guard = ShapeGuard()
        self.guard.__enter__()
        return self.rec

    def __exit__(self, *exc: Any) -> None:
        self.guard.__exit__(*exc)
        _dispatch.ACTIVE[0] -= 1
        _LOCAL.recorder = self.saved


# ----- the sample stand-in -----------------------------------------------------------
_SAMPLE_STATIC = frozenset(
    {"layout", "dtype", "device", "ndim", "dim", "num_ragged", "is_nested", "ragged_dims"}
)


class SampleStandIn(Ragged):
    """A sample of a nested value while ``f`` is recorded: a one-level ``Ragged`` whose
    fields are the first example's; ``f`` may pass it to raggedfn ops and operators,
    read its layout, dtype and device, nothing that depends on the sample's sizes."""

    _examples: tuple[Ragged, Ragged]
    _ref: Ref

    @classmethod
    def make(cls, examples: tuple[Ragged, Ragged], ref: Ref) -> SampleStandIn:
        a = examples[0]
        obj = cls._make(a.values, a.offsets, a.sizes, a.layout, a.row_offsets)
        object.__setattr__(obj, "_examples", examples)
        object.__setattr__(obj, "_ref", ref)
        return obj  # type: ignore[return-value]

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") or name in _SAMPLE_STATIC or name == "make":
            return object.__getattribute__(self, name)
        recorder().fail(f"f reads the sample's {name!r}")

    def __len__(self) -> int:
        recorder().fail("f reads the sample's length (len)")

    def __iter__(self) -> Any:
        recorder().fail("f iterates over the sample's rows")

    def __getitem__(self, index: Any) -> Any:
        recorder().fail("f indexes the sample")

    def __bool__(self) -> bool:
        recorder().fail("f reads the sample as a bool")

    def __repr__(self) -> str:
        return f"SampleStandIn({self.layout})"

    __raggedfn_function__: Callable[..., Any]


class DenseStandIn(Tensor):
    """A per-sample tensor while ``f`` is recorded: a tensor with the first example's
    shape (its data is not read); torch functions on it are recorded."""

    _examples: tuple[Tensor, Tensor]
    _ref: Ref
    _tainted: bool

    @staticmethod
    def make(examples: tuple[Tensor, Tensor], ref: Ref, tainted: bool = False) -> DenseStandIn:
        """``tainted``: its shape may follow the sample's data (``nonzero``, a mask index),
        which the zero-filled examples do not show: every size follows the sample."""
        a = examples[0]
        with torch._C.DisableTorchFunctionSubclass():
            shell = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        obj = Tensor._make_subclass(DenseStandIn, shell, False)
        obj._examples = examples
        obj._ref = ref
        obj._tainted = tainted
        return obj

    __raggedfn_function__: Callable[..., Any]
    __torch_function__: Any


# torch functions that read metadata which never follows the sample
_STATIC_META = {
    Tensor.dim,
    Tensor.ndimension,
    Tensor.is_floating_point,
    Tensor.is_complex,
    Tensor.element_size,
    Tensor.get_device,
    Tensor.ndim.__get__,  # type: ignore[attr-defined]
    Tensor.dtype.__get__,  # type: ignore[attr-defined]
    Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.layout.__get__,  # type: ignore[attr-defined]
    Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    Tensor.__repr__,
    Tensor.__format__,
}
# functions whose result's shape follows the data
_DATA_SHAPES = {
    torch.nonzero, Tensor.nonzero, torch.masked_select, Tensor.masked_select,
    torch.unique, Tensor.unique, torch.unique_consecutive, Tensor.unique_consecutive,
    torch.argwhere, Tensor.argwhere, torch.repeat_interleave, Tensor.repeat_interleave,
    torch.bincount, Tensor.bincount, torch.where, torch.Tensor.nonzero_static,
}  # fmt: skip
_SIZES = {Tensor.size, Tensor.shape.__get__}  # type: ignore[attr-defined]
# autograd state: the examples are computed without autograd, so it is not known
_AUTOGRAD = {
    getattr(Tensor, name).__get__ for name in ("requires_grad", "grad_fn", "is_leaf", "grad")
}
_WRITES = {Tensor.__setitem__, Tensor.requires_grad_, Tensor.retain_grad, Tensor.backward}


class SampleShape(tuple):  # torch.Size cannot be subclassed
    """A per-sample tensor's shape: the sizes that follow the sample (they differ between
    the two examples) may not be read, only the others (``t.shape[-1]``)."""

    _varying: tuple[bool, ...]

    @staticmethod
    def make(a: torch.Size, b: torch.Size) -> Any:
        varying = tuple(x != y for x, y in zip(a, b, strict=True))
        if not any(varying):
            return a
        shape = SampleShape(a)
        shape._varying = varying
        return shape

    def _check(self, index: Any) -> None:
        dims = range(len(self))[index]
        for d in dims if isinstance(dims, range) else (dims,):
            if self._varying[d]:
                recorder().fail(f"f reads a size that follows the sample (t.shape[{d}])")

    def __getitem__(self, index: Any) -> Any:
        self._check(index)
        if isinstance(index, slice):
            return torch.Size(tuple.__getitem__(self, index))
        return tuple.__getitem__(self, index)

    def __iter__(self) -> Any:
        self._check(slice(None))
        return tuple.__iter__(self)

    def _refuse(self, *args: Any) -> Any:
        recorder().fail("f reads the shape of a per-sample tensor whose sizes follow the sample")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = _refuse
    numel = __repr__ = _refuse  # type: ignore[assignment]


class ShapeGuard(TorchFunctionMode):
    """While recording: a torch function given a ``SampleShape`` reads its sizes."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, SampleShape) or (
                isinstance(value, (list, tuple)) and any(isinstance(v, SampleShape) for v in value)
            ):
                recorder().fail(f"f passes a per-sample shape to {_name(func)}")
        return func(*args, **kwargs)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _example(value: Any, k: int) -> Any:
    if isinstance(value, (SampleStandIn, DenseStandIn)):
        return object.__getattribute__(value, "_examples")[k]
    return value


def _template(value: Any) -> Any:
    if isinstance(value, (SampleStandIn, DenseStandIn)):
        return object.__getattribute__(value, "_ref")
    return value


def _is_stand_in(value: Any) -> bool:
    return isinstance(value, (SampleStandIn, DenseStandIn))


def _wrap(rec: Recorder, fn: Any, results: tuple[Any, Any], tainted: bool) -> tuple[Any, Any]:
    """Stand-ins for ``fn``'s results on both examples, and the output template."""
    a, b = results
    if type(a) is Tensor and type(b) is Tensor:  # the common case, without pytree
        dense = DenseStandIn.make((a, b), rec.new_ref(), tainted)
        return dense, object.__getattribute__(dense, "_ref")
    if type(a) is Ragged and type(b) is Ragged and a.layout == b.layout:
        sample = SampleStandIn.make((a, b), rec.new_ref())
        return sample, object.__getattribute__(sample, "_ref")
    flat_a, spec_a = pytree.tree_flatten(a, is_leaf=is_leaf)
    flat_b, spec_b = pytree.tree_flatten(b, is_leaf=is_leaf)
    if spec_a != spec_b:
        rec.fail(f"{_name(fn)} returns a structure that follows the sample's sizes")
    outs: list[Any] = []
    for one, two in zip(flat_a, flat_b, strict=True):
        if isinstance(one, Ragged) and isinstance(two, Ragged):
            if one.layout != two.layout:
                rec.fail(f"{_name(fn)} returns layouts that follow the sample's sizes")
            outs.append(SampleStandIn.make((one, two), rec.new_ref()))
        elif isinstance(one, Tensor) and isinstance(two, Tensor):
            outs.append(DenseStandIn.make((one, two), rec.new_ref(), tainted))
        elif one is None and two is None:
            outs.append(None)
        else:
            rec.fail(f"{_name(fn)} returns {type(one).__name__}, not a tensor or Ragged")
    out = pytree.tree_unflatten(outs, spec_a)
    return out, pytree.tree_map(_template, out, is_leaf=is_leaf)


def _ref_or_none(value: Any) -> Any:
    if isinstance(value, (SampleStandIn, DenseStandIn)):
        return object.__getattribute__(value, "_ref")
    return None


def _remembered(rec: Recorder, fn: Any, args: Any, kwargs: Any) -> Any:
    """The last record's example results of this op, where everything so far matched."""
    try:
        key: Any = (fn, tree_map(lambda v: _memo.leaf_key(v, _ref_or_none), (args, kwargs)))
    except _memo.NoKey:
        key = None
    position = len(rec.memo)
    rec.memo.append((key, None))
    previous = rec.previous
    if previous is None or key is None or position >= len(previous):
        rec.previous = None
        return None
    last_key, results = previous[position]
    if results is None or last_key != key:
        rec.previous = None  # f went another way: examples from here on are computed
        return None
    rec.memo[-1] = (key, results)
    return results


def _record(
    rec: Recorder,
    kind: str,
    fn: Any,
    run: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tainted: bool = False,
) -> Any:
    """Compute ``run`` on both examples and record a node (``fn`` with the templates)."""
    results = _remembered(rec, fn, args, kwargs)
    if results is None:
        results = []
        for k in (0, 1):
            args_k, kwargs_k = tree_map(functools.partial(_example, k=k), (args, kwargs))
            # plain examples (no mode, no stand-in), without autograd: only their types
            # and shapes matter (so f may not read a stand-in's requires_grad)
            with torch._C.DisableTorchFunction(), torch.no_grad():
                results.append(run(*args_k, **kwargs_k))
        if rec.memo and rec.memo[-1][0] is not None and not _memo.requires_grad(results):
            rec.memo[-1] = (rec.memo[-1][0], results)
        else:
            rec.memo[-1] = (None, None)
    out, template = _wrap(rec, fn, (results[0], results[1]), tainted)
    node_args, node_kwargs = tree_map(_template, (args, kwargs))
    rec.nodes.append(Node(kind, fn, tuple(node_args), dict(node_kwargs), template))
    return out


def _torch_function(
    cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
) -> Any:
    kwargs = kwargs or {}
    rec = recorder()
    leaves = tree_leaves((args, kwargs))
    if any(isinstance(v, SampleStandIn) for v in leaves):
        return NotImplemented  # x * sample: Python tries the sample's reflected operator
    if func in _STATIC_META:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*tree_map(lambda v: _example(v, 0), args), **kwargs)
    name = _name(func)
    if func in _AUTOGRAD:
        rec.fail(f"f reads the autograd state of a per-sample tensor ({name})")
    if func in _SIZES:
        with torch._C.DisableTorchFunctionSubclass():
            sizes = [
                func(*tree_map(functools.partial(_example, k=k), args), **kwargs) for k in (0, 1)
            ]
        if any(isinstance(v, DenseStandIn) and v._tainted for v in leaves):
            rec.fail("f reads the shape of a tensor whose sizes follow the sample's data")
        if isinstance(sizes[0], int):  # t.size(d)
            if sizes[0] != sizes[1]:
                rec.fail(f"f reads a size that follows the sample (t.size({args[1:]})")
            return sizes[0]
        return SampleShape.make(sizes[0], sizes[1])
    if func in _WRITES or "out" in kwargs or (name.endswith("_") and not name.endswith("__")):
        rec.fail(f"f writes into a per-sample tensor ({name})")
    if name.split(".")[-1].startswith("__i") and name.endswith("__"):  # x += y
        rec.fail(f"f writes into a per-sample tensor ({name})")

    def run(*a: Any, **k: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*a, **k)

    tainted = func in _DATA_SHAPES or any(
        isinstance(v, DenseStandIn)
        and (v._tainted or (func is Tensor.__getitem__ and v.dtype == torch.bool))
        for v in leaves
    )
    return _record(rec, "sample", func, run, args, kwargs, tainted)


DenseStandIn.__torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]


def refuse_stand_ins(args: Any) -> None:
    """``raggedfn.map`` inside ``f`` given a stand-in: the loop's (as one-level map)."""
    if _dispatch.ACTIVE[0] and any(
        isinstance(v, (SampleStandIn, DenseStandIn))
        for v in pytree.tree_leaves(args, is_leaf=is_leaf)
    ):
        recorder().fail("f calls raggedfn.map on a value of the sample (a map inside f)")
