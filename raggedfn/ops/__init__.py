"""Public pure functions over ``Ragged`` values, grouped by kind.

Each submodule defines ``__all__``; this package re-exports them all.
"""

from . import (
    _attention,
    _broadcast,
    _compile,
    _elementwise,
    _nn,
    _products,
    _reduce,
    _scan,
    _select,
    _shape,
    _softmax,
)
from ._attention import *  # noqa: F403
from ._broadcast import *  # noqa: F403
from ._compile import *  # noqa: F403
from ._elementwise import *  # noqa: F403
from ._nn import *  # noqa: F403
from ._products import *  # noqa: F403
from ._reduce import *  # noqa: F403
from ._scan import *  # noqa: F403
from ._select import *  # noqa: F403
from ._shape import *  # noqa: F403
from ._softmax import *  # noqa: F403

__all__: list[str] = []
__all__ += _products.__all__
__all__ += _attention.__all__
__all__ += _select.__all__
__all__ += _broadcast.__all__ + _elementwise.__all__ + _nn.__all__ + _shape.__all__
__all__ += _reduce.__all__ + _scan.__all__ + _softmax.__all__
__all__ += _compile.__all__
