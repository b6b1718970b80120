"""Public pure functions over ``Ragged`` values, grouped by kind.

Each submodule defines ``__all__``; this package re-exports them all.
"""

__all__: list[str] = []
