"""Forward-mode AD plumbing shared by the primitives.

Every custom ``torch.autograd.Function`` in ``_prims`` comes in two classes: the
base class (``forward``, ``setup_context``, ``backward``) and a subclass that
adds the explicit forward-mode rule (``jvp``). :func:`call` picks per call:

* eager: the subclass, so ``torch.func.jvp``/``jacfwd``/``hessian``/``linearize``
  and ``torch.autograd.forward_ad`` work;
* traced by ``torch.compile``: the base class, since dynamo 2.13 refuses a
  Function that defines ``jvp`` on its autograd path ("Unsupported custom jvp");
  compiled ``backward()`` uses the custom backward as before;
* traced by ``torch.compile`` inside a ``torch.func`` transform
  (``torch.compile(torch.func.jvp(f, ...))``, also ``grad``/``vmap``) or with
  forward mode active: the forward body as plain torch ops. There dynamo never
  calls a Function's ``backward`` or ``jvp``: with inputs that do not require
  grad it inlines ``forward`` and the transform differentiates its torch ops;
  with inputs that do, it records the Function as a higher-order op that
  ``vmap`` (``jacfwd``, ``hessian``) cannot batch ("You tried to vmap over
  ApplyTemplate"). Calling the body directly gives the first behaviour always;
  the bodies are written so that torch's own rules give the Function's
  derivatives, except where :func:`refuse_compiled` names the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from .._errors import fail
from ._apply import apply


def call(
    eager: type[torch.autograd.Function],
    compiled: type[torch.autograd.Function],
    body: Callable[..., Any],
    *args: Any,
) -> Any:
    """Apply a primitive's rule set for this call.

    Args:
        eager: the Function with the ``jvp`` rule.
        compiled: its jvp-less base class, for code that dynamo traces.
        body: the Function's forward as plain torch ops with the same
            derivatives, for transforms and forward mode inside compiled code
            (see the module docstring).
        args: the Function's inputs.
    """
    if not torch.compiler.is_compiling():
        if _untracked(args):
            # nothing to differentiate: the forward alone, without a Function's bookkeeping
            return eager.forward(*args)
        return apply(eager, *args)  # eager.apply(*args) without its per-call signature binding
    if compiled_transform():
        return body(*args)
    return compiled.apply(*args)


def _untracked(args: tuple[Any, ...]) -> bool:
    """Eagerly, no derivative of this call can be asked for: no ``torch.func`` transform,
    no forward-mode AD, and grad mode off or no tensor argument requiring grad."""
    if forward_mode() or torch._C._are_functorch_transforms_active():
        return False
    if not torch.is_grad_enabled():
        return True
    for a in args:
        if isinstance(a, Tensor) and a.requires_grad:
            return False
    return True


def plain_eager() -> bool:
    """Eager, outside ``torch.func`` transforms and forward mode: an in-place op on a fresh
    buffer is recorded by autograd like its out-of-place form (transforms may refuse to
    write a batched value into an unbatched buffer)."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or forward_mode()
    )


def compiled_transform() -> bool:
    """Dynamo is tracing inside a ``torch.func`` transform or with forward mode active."""
    return torch.compiler.is_compiling() and (
        forward_mode() or torch._C._are_functorch_transforms_active()
    )


def forward_mode() -> bool:
    """True while forward-mode AD may be active.

    ``torch.func.jvp`` (and so ``jacfwd``, ``hessian``, ``linearize``) enters a
    ``torch.autograd.forward_ad`` dual level like user code does, so the level
    counter of that module covers both; dynamo reads it while tracing (and
    guards on it), so this also works under ``torch.compile``.
    """
    return fwAD._current_level >= 0


def has_tangent(*tensors: Tensor | None) -> bool:
    """True when a forward-mode tangent may reach a computation on ``tensors``.

    Exact for plain dual tensors (``forward_ad.make_dual``); inside ``torch.func``
    transforms (functorch-wrapped tensors, whose tangent may sit at any level of
    the transform stack) and while compiling it answers True whenever forward
    mode is active, which is never wrong: a True only routes to a path that has
    forward-mode rules.
    """
    if not forward_mode():
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return True
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)


def refuse_compiled(fn: str, why: str) -> None:
    """Raise ``RaggedError`` for forward-mode AD reaching ``fn`` inside compiled code."""
    if torch.compiler.is_compiling() and forward_mode():
        raise fail(
            fn,
            f"forward-mode AD (torch.func.jvp, jacfwd, hessian, linearize or forward_ad dual "
            f"tensors) inside torch.compile is not supported: {why}; call the transform "
            f"outside torch.compile (eagerly)",
        )
