"""Batching rules: one per aten op, written with raggedfn's public ops."""

# Importing a rule module registers its rules (base._registry): importing this package
# registers every rule.
from . import _attention, _index, _linalg, _pointwise, _reduce, _select, _shape, _slice

__all__ = [
    "_attention",
    "_index",
    "_linalg",
    "_pointwise",
    "_reduce",
    "_select",
    "_shape",
    "_slice",
]
