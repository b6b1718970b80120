"""The one error type of raggedfn and helpers that word its messages."""

from __future__ import annotations

from typing import Any

import torch


class RaggedError(ValueError):
    """Bad input to a raggedfn function.

    Messages name the function, the argument, what was expected and what
    arrived, e.g. ``sum: axis 3 is out of range for a sample of rank 2
    (logical shape (N*, 64))``.
    """


def fail(fn: str, message: str) -> RaggedError:
    """Build (not raise) a ``RaggedError`` prefixed by the function name."""
    return RaggedError(f"{fn}: {message}")


def describe(value: Any) -> str:
    """A short description of what arrived, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"{type(value).__name__} {value!r}"[:200]
