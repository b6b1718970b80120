"""A hook on the public ops for stand-in arguments (``map`` over nested values).

While a stand-in exists (``ACTIVE[0] > 0``), a public op called with an argument
whose type defines ``__raggedfn_function__`` hands the call to that method instead of
running: ``map`` over a nested value records the ops ``f`` applies to a stand-in
sample and runs them once on the whole batch. Otherwise the op runs as it is (one
list read per call). The value layer knows nothing of ``map``: this is the protocol.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# how many recordings are under way (a list: read by reference, cheap for dynamo)
ACTIVE = [0]


def _handler(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, (list, tuple)):  # cat([a, b]), broadcast_tensors
            for item in arg:
                found = getattr(type(item), "__raggedfn_function__", None)
                if found is not None:
                    return found
        found = getattr(type(arg), "__raggedfn_function__", None)
        if found is not None:
            return found
    return None


def dispatching(fn: F) -> F:
    """``fn`` as a public op: calls with a stand-in argument go to its handler."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        if ACTIVE[0]:
            handler = _handler(args, kwargs)
            if handler is not None:
                return handler(op, args, kwargs)
        return fn(*args, **kwargs)

    return op  # type: ignore[return-value]
