"""``Ragged`` as a pytree node of torch's Python and C++ pytrees and of optree (namespace
``raggedfn``), with key paths and a JSON-able spec context, and as a class that
``torch.load(weights_only=True)`` may build. Imported once by the package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import Tensor

from ._layout import Axis, Layout
from ._ragged import OPTREE_NAMESPACE, Ragged
from ._validate import check_structure

# Unflatten checks the structure (cheap, no device sync) when the leaves are
# tensors: a corrupted leaf raises instead of building a silently wrong value.
# Other leaves (tree_map to shapes or in_dims specs) make a plain structure
# holder, as pytree containers are, which no raggedfn op accepts as a value.


def _unflatten_leaves(fn: str, leaves: Any, layout: Layout) -> Ragged:
    values, offsets, sizes, *rest = leaves
    row_offsets = tuple(rest)
    if isinstance(values, Tensor) or isinstance(offsets, Tensor) or isinstance(sizes, Tensor):
        check_structure(fn, values, offsets, sizes, layout, row_offsets)
    return Ragged._make(values, offsets, sizes, layout, row_offsets)


def _flatten(x: Ragged) -> tuple[list[Any], Layout]:
    return [x.values, x.offsets, x.sizes, *x.row_offsets], x.layout


def _unflatten(leaves: Any, layout: Layout) -> Ragged:
    return _unflatten_leaves("tree_unflatten", leaves, layout)


@dataclass(frozen=True)
class RowOffsetsKey(torch_pytree.GetAttrKey):
    """Pytree key of ``x.row_offsets[level]``: a ``GetAttrKey`` named ``row_offsets_{level}``
    (``keystr`` shows ``.row_offsets_{level}``), whose ``get`` indexes ``row_offsets``.

    ``torch.export`` knows only torch's own key types: it names a program's inputs
    after the key path and matches its input guards to the inputs by ``keystr``.
    """

    level: int = 0

    def get(self, obj: Ragged) -> Tensor:
        return obj.row_offsets[self.level]


def _flatten_with_keys(x: Ragged) -> tuple[list[tuple[Any, Any]], Layout]:
    keys = (torch_pytree.GetAttrKey(n) for n in ("values", "offsets", "sizes"))
    entries: list[tuple[Any, Any]] = [(k, getattr(x, k.name)) for k in keys]
    entries += [(RowOffsetsKey(f"row_offsets_{k}", k), p) for k, p in enumerate(x.row_offsets)]
    return entries, x.layout


def _to_dumpable_context(layout: Layout) -> str:
    """The JSON-able form of a spec's context (``treespec_dumps``): the layout code."""
    return layout.code


def _from_dumpable_context(code: Any) -> Layout:
    return Layout(code)  # validates the code (RaggedError)


torch_pytree.register_pytree_node(
    Ragged,
    _flatten,
    _unflatten,
    serialized_type_name="raggedfn.Ragged",
    flatten_with_keys_fn=_flatten_with_keys,
    to_dumpable_context=_to_dumpable_context,
    from_dumpable_context=_from_dumpable_context,
)


def _optree_flatten(x: Ragged) -> tuple[list[Any], Layout, tuple[str, ...]]:
    names = (
        "values",
        "offsets",
        "sizes",
        *(f"row_offsets[{k}]" for k in range(len(x.row_offsets))),
    )
    return [x.values, x.offsets, x.sizes, *x.row_offsets], x.layout, names


def _optree_unflatten(layout: Layout, leaves: Any) -> Ragged:
    return _unflatten_leaves("optree.tree_unflatten", leaves, layout)


optree.register_pytree_node(
    Ragged,  # type: ignore[arg-type]  # optree's stubs expect a Collection type
    _optree_flatten,  # type: ignore[arg-type]
    _optree_unflatten,  # type: ignore[arg-type]
    namespace=OPTREE_NAMESPACE,
)
# torch mirrors registrations into optree's "torch" namespace when this module is
# imported; it must come after registering (registering there directly breaks it).
import torch.utils._cxx_pytree  # noqa: E402

# torch.load defaults to weights_only=True, which builds only allowlisted classes;
# unpickling a Ragged or Layout validates it (__setstate__).
torch.serialization.add_safe_globals([Ragged, Layout, Axis])
