"""Inside ``torch.compile``: where every tensor of a record comes from.

Eagerly a record holds the tensors ``f`` passed to its ops (its shared arguments, the
tensors it captures, tensors it made from those, such as ``w[None]``) and runs afresh
at every call. A compiled region records ``f`` once, outside dynamo's view, on real
values, and replays the record in the graph: there each such tensor must be the
region's own value, never a constant of the record. While ``f`` is recorded for a
compiled region, :class:`Outside` records the torch functions ``f`` applies to
values other than the sample's as *made* nodes (run again in the graph, on the
region's values), and names every tensor by :class:`._replay.Captured`: a leaf of
``map``'s arguments, a tensor ``f`` captures (a lifted slot of its dependency check)
or a made one. A tensor it cannot name, a write into one of them, or a Python value
read from their data (``float(w)``, ``if w.any():``: the record would keep the
value of the moment) make the record fail, and ``map`` says why.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..._ragged import Ragged
from ._replay import Captured
from ._stand_ins import DenseStandIn, SampleStandIn, _name, recorder, tree_leaves, tree_map


class Made(NamedTuple):
    """A torch function ``f`` applied to values other than the sample's."""

    fn: Any
    args: tuple[Any, ...]  # tensors as Captured (Unknown where not found)
    kwargs: dict[str, Any]
    slots: tuple[int | None, ...]  # the made index of each pytree leaf of the result
    grad: bool | None  # the grad mode f set around it (``torch.no_grad()``), or None


class Unknown(NamedTuple):
    """A tensor no compiled region has (found in no argument, capture or made result)."""

    what: str


# torch functions whose Python result follows a tensor's data
_DATA_READS = frozenset(
    {
        "item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__complex__",
        "numpy", "__array__", "equal", "allclose", "is_nonzero", "data_ptr",
    }
)  # fmt: skip


def _is_write(name: str, kwargs: dict[str, Any]) -> bool:
    last = name.split(".")[-1]
    if "out" in kwargs or last in ("__setitem__", "requires_grad_", "backward", "retain_grad"):
        return True
    if last.startswith("__i") and last.endswith("__"):  # w += 1
        return True
    return last.endswith("_") and not last.endswith("__")


class Outside(TorchFunctionMode):
    """Records torch functions on values other than the sample's (see the module)."""

    def __init__(self, known: dict[int, Captured], keep: list[Any]) -> None:
        super().__init__()
        self.known = known  # id(tensor) -> where the compiled region has it
        self.keep = keep  # the tensors named by id, kept alive (ids stay unique)
        self.made: list[Made] = []
        self.count = 0
        self.grad = torch.is_grad_enabled()  # the mode around f (the graph's, replayed)

    def name(self, value: Any) -> Any:
        if isinstance(value, Ragged):  # not the sample's: the record would keep it
            return Unknown(f"a Ragged value of layout {value.layout}")
        if not isinstance(value, Tensor):
            return value
        found = self.known.get(id(value))
        if found is not None:
            return found
        return Unknown(f"a tensor of shape {tuple(value.shape)}")

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(v, (SampleStandIn, DenseStandIn)) for v in leaves):
            return func(*args, **kwargs)  # an op of the sample: the record's own
        known = any(isinstance(v, Tensor) and id(v) in self.known for v in leaves)
        name = _name(func)
        if known and name.split(".")[-1] in _DATA_READS:
            recorder().fail(
                f"inside torch.compile, f reads a Python value from a tensor's data ({name})"
            )
        if known and _is_write(name, kwargs):
            recorder().fail(f"inside torch.compile, f writes into a tensor it was given ({name})")
        out = func(*args, **kwargs)
        flat = pytree.tree_leaves(out)
        if not any(isinstance(v, Tensor) for v in flat):
            return out  # metadata (shapes, dtypes): the same in the graph, which guards them
        # named before its results: one may be an input itself (``w.contiguous()``)
        node_args, node_kwargs = tree_map(self.name, (tuple(args), dict(kwargs)))
        slots: list[int | None] = []
        for value in flat:
            if isinstance(value, Tensor):
                self.known[id(value)] = Captured("made", self.count)
                self.keep.append(value)
                slots.append(self.count)
                self.count += 1
            else:
                slots.append(None)
        self.keep.append(out)
        grad = torch.is_grad_enabled()
        where = None if grad == self.grad else grad
        self.made.append(Made(func, node_args, node_kwargs, tuple(slots), where))
        return out


def needed(made: list[Made], reads: list[Any]) -> list[Made]:
    """The made nodes whose results ``reads`` (values holding ``Captured``) reach, in
    order; raises ``LookupError`` naming a tensor no compiled region has."""
    wanted = {c.index for c in _captured(reads) if c.kind == "made"}
    kept: list[Made] = []
    for node in reversed(made):
        if not any(s in wanted for s in node.slots if s is not None):
            continue
        kept.append(node)
        for value in tree_leaves((node.args, node.kwargs)):
            if isinstance(value, Unknown):
                raise LookupError(value.what)
            if isinstance(value, Captured) and value.kind == "made":
                wanted.add(value.index)
    kept.reverse()
    return kept


def _captured(values: list[Any]) -> list[Captured]:
    return [v for v in tree_leaves(values) if isinstance(v, Captured)]


__all__ = ["Made", "Outside", "Unknown", "needed"]
