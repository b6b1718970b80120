"""Calling a custom ``torch.autograd.Function`` without ``Function.apply``'s per-call cost.

``Function.apply`` (torch 2.13) binds the arguments to ``inspect.signature(forward)``
on every call when the Function defines ``setup_context`` (the torch.func form every
rule here uses), to fill in default arguments: tens of microseconds, more than a
segment kernel on a small input. The rules here take no default arguments and are
called with all of them, so in plain eager code this goes straight to the C++
``apply`` that ``Function.apply`` ends in. Under ``torch.compile`` (dynamo traces
``Function.apply`` itself) and under ``torch.func`` transforms (which route through
``custom_function_call``) it calls ``Function.apply`` unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch._functorch.utils import unwrap_dead_wrappers

# Function class -> number of forward parameters (read once, not on every call)
_ARITY: dict[type, int] = {}


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``, with every forward argument passed positionally."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    arity = _ARITY.get(function)
    if arity is None:
        arity = _ARITY[function] = _arity(function)
    if len(args) != arity:  # a default argument to fill in (or not a Function): the general path
        return function.apply(*args)
    # what Function.apply does after binding: unwrap dead functorch wrappers, C++ apply
    return super(torch.autograd.Function, function).apply(*unwrap_dead_wrappers(args))  # type: ignore[misc]


def _arity(function: type) -> int:
    """Parameters of a Function's ``forward``; -1 for anything else with an ``apply``."""
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        return -1
    return len(inspect.signature(function.forward).parameters)
