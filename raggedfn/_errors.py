"""The one error type of raggedfn and helpers that word its messages.

Messages follow one style: ``fn: expected ..., got ...`` with logical shapes.
They are built with f-strings only (never ``str()`` of a size): under
``torch.compile(dynamic=True)`` sizes are symbolic, and dynamo formats a
symbolic size in an f-string but refuses ``str()`` of it (torch 2.13).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class RaggedError(ValueError):
    """Bad input to a raggedfn function.

    Messages name the function, the argument, what was expected and what
    arrived, e.g. ``sum: axis 3 is out of range for a sample of rank 2
    (logical shape (N*, 64))``.

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.zeros(2, 64)])
        >>> try:
        ...     raggedfn.sum(x, 3)
        ... except raggedfn.RaggedError as error:
        ...     print(error)
        sum: axis 3 is out of range for a sample of rank 2 (logical shape (N*, 64))
        >>> issubclass(raggedfn.RaggedError, ValueError)
        True
    """


class RaggedPerformanceWarning(UserWarning):
    """raggedfn ran something per sample (a Python loop) where it could not batch it.

    The result is still the per-sample loop's; only speed suffers. ``raggedfn.map``
    emits one for the first per-sample fallback of each op (or of the whole
    function) per input signature, naming the op and the reason;
    ``raggedfn.map_report`` lists them all. Silence it with
    ``warnings.filterwarnings("ignore", category=raggedfn.RaggedPerformanceWarning)``.

    Examples:
        >>> import warnings, torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = raggedfn.map(lambda t: torch.flip(t, [0]).sum(0), x)
        >>> caught[0].category.__name__
        'RaggedPerformanceWarning'
    """


def fail(fn: str, message: str) -> RaggedError:
    """Build (not raise) a ``RaggedError`` prefixed by the function name."""
    return RaggedError(f"{fn}: {message}")


def shape_text(shape: Iterable[Any]) -> str:
    """``(2, 3)`` for a shape; safe for symbolic sizes under ``torch.compile``."""
    parts = [f"{d}" for d in shape]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def describe(value: Any) -> str:
    """A short description of what arrived, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {shape_text(value.shape)} on {value.device}"
    return f"{type(value).__name__} {value!r}"[:200]


def require_ordered(fn: str, dtype: torch.dtype) -> None:
    """Refuse complex dtypes for ops that compare values (max, sort, ...)."""
    if dtype.is_complex:
        raise fail(
            fn, f"expected a real dtype (complex numbers have no order), got values of {dtype}"
        )
