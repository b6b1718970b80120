"""Public pure functions over ``Ragged`` values, grouped by kind.

Each submodule defines ``__all__``; this package re-exports them all.
"""

from . import _products
from ._products import *  # noqa: F403

__all__: list[str] = []
__all__ += _products.__all__
