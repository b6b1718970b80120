"""Generator states for ``randomness="same"``: every sample starts from one state.

``torch.func.vmap(randomness="same")`` makes one draw of the per-sample shape and shares
it with the batch. ``map`` runs a batch as several pieces (groups of samples under
different plans, chunks of consecutive samples, per-sample loops), each of which draws
afresh; under ``"same"`` each piece therefore starts from the generator state the call
started with, so that every sample sees the draws one sample alone would make.
"""

from __future__ import annotations

from typing import Any

import torch


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The states of the generators a random op may draw from: the CPU one, and the CUDA
    ones where CUDA is initialised (a random op on a CUDA tensor draws from those)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    """Restore a state from :func:`rng_state`."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def same_start(randomness: str, plans: Any = None) -> Any:
    """Under ``"same"``: a function that puts the generators back to their state now (call
    it before each piece of the batch runs); else ``None``. ``plans``: skip the copy of
    the state when none of them draws random numbers (the per-sample loop gives
    ``None``: it may draw in ways no plan recorded)."""
    if randomness != "same" or torch.compiler.is_compiling():
        return None
    if plans is not None and not any(step.random for plan in plans for step in plan.steps):
        return None
    state = rng_state()
    return lambda: set_rng_state(state)


__all__ = ["rng_state", "same_start", "set_rng_state"]
