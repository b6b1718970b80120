"""Modules sharded by FSDP2 (``fully_shard``) that ``f`` calls: one forward per ``map`` call.

FSDP2 gathers a module's parameters in a forward pre-hook, frees them in a forward
hook, and hooks autograd on the module's inputs (reduce-scatter of the gradients
once their backward is done) and outputs (gather again before the backward). A
batched trace runs the module once, on fake samples, and a per-sample loop runs
it once per sample: neither is one forward of the whole batch.

So the whole ``map`` call is that forward. Before it, every sharded module that
``f`` can reach and that is not already in a forward of its own gets FSDP2's own
pre-forward (one all-gather per module, its post-backward hook on ``map``'s
inputs that need gradients); during it, the modules' hooks are put in the state
FSDP2 itself uses for recomputation under activation checkpointing (parameters
already gathered, nothing registered), so tracing or looping over ``f`` changes
nothing; after it, FSDP2's post-forward (reshard, pre-backward hook on ``map``'s
outputs). Gradients reach the gathered parameters through ``map``'s plan and FSDP2
reduce-scatters them as for any module.

What is gathered depends only on what ``f`` reaches and on FSDP2's state, the same
on every rank, never on this rank's trace, cache or samples: ranks make the same
collectives in the same order.

Reaching a module: through closure cells, bound ``self``, defaults,
``functools.partial``, globals ``f``'s code names (and those of the user functions
found there), containers, attributes of user objects, and submodules. A sharded
module ``f`` calls but that is not found this way is refused when ``f`` is traced.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..._ragged import Ragged
from ..tracing._deps import _code_names, is_library_file
from ..tracing._trace import tracing

_MAX_DEPTH = 12
_MAX_ITEMS = 256

# FSDP states whose forward is the current map call (their hooks are benign meanwhile)
_ACTIVE: set[int] = set()
# map calls under way in this thread: a map inside f (run per sample) gathers nothing
_LOCAL = threading.local()


def _states() -> Any:
    """torch's registry of composable states (FSDP2's included), ``None`` when empty."""
    composable = sys.modules.get("torch.distributed._composable_state")
    mapping = getattr(composable, "_module_state_mapping", None)
    return mapping if mapping else None


def _fsdp() -> tuple[Any, Any] | None:
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_state")
    if module is None:
        return None
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return FSDPModule, TrainingState


def _user(value: Any) -> bool:
    code = getattr(value, "__code__", None)
    return code is not None and not is_library_file(code.co_filename)


def reachable(roots: list[Any], kind: type) -> list[torch.nn.Module]:
    """The modules of type ``kind`` that ``roots`` reach (see the module docstring)."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(r, 0) for r in reversed(roots)]
    while todo:
        value, depth = todo.pop()
        if id(value) in seen or depth > _MAX_DEPTH or isinstance(value, torch.Tensor):
            continue
        seen.add(id(value))
        nxt = depth + 1
        if isinstance(value, torch.nn.Module):
            for m in value.modules():
                if isinstance(m, kind):
                    found.setdefault(id(m), m)
            continue
        items: list[Any] = []
        if isinstance(value, types.FunctionType):
            if not _user(value):
                continue
            for cell in value.__closure__ or ():
                try:
                    items.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            items.extend(value.__defaults__ or ())
            items.extend((value.__kwdefaults__ or {}).values())
            names, _ = _code_names(value.__code__)
            items.extend(value.__globals__[n] for n in sorted(names) if n in value.__globals__)
        elif isinstance(value, types.MethodType):
            items = [value.__self__, value.__func__]
        elif isinstance(value, functools.partial):
            items = [value.func, *value.args, *value.keywords.values()]
        elif isinstance(value, (list, tuple)):
            items = list(value[:_MAX_ITEMS])
        elif isinstance(value, dict):
            items = list(value.values())[:_MAX_ITEMS]
        elif isinstance(value, (types.ModuleType, type)):
            continue
        elif hasattr(value, "__dict__") and not is_library_file(
            getattr(sys.modules.get(type(value).__module__), "__file__", None) or "<frozen"
        ):
            items = list(vars(value).values())[:_MAX_ITEMS]
        todo.extend((item, nxt) for item in reversed(items))
    return list(found.values())


def active(module: torch.nn.Module) -> bool:
    """Whether ``module``'s FSDP2 hooks are benign now: its forward is the current map
    call, or it is in its backward (recomputation under activation checkpointing)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    state = _get_module_fsdp_state(module)
    if state is None:
        return False
    found = _fsdp()
    assert found is not None
    return id(state) in _ACTIVE or state._training_state == found[1].PRE_BACKWARD


def own_hooks(module: torch.nn.Module) -> set[int]:
    """The ids of the forward hooks FSDP2 registered on ``module``."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    state = _get_module_fsdp_state(module)
    ids: set[int] = set()
    for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        key = getattr(getattr(state, name, None), "id", None)
        if isinstance(key, int):
            ids.add(key)
    return ids


def _grad_tensors(args: tuple[Any, ...]) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = pytree.tree_flatten(args, is_leaf=lambda v: isinstance(v, Ragged))
    where = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, (Ragged, torch.Tensor))
        and (leaf.values if isinstance(leaf, Ragged) else leaf).requires_grad
    ]
    return leaves, spec, where


def around(f: Callable[..., Any], args: tuple[Any, ...], call: Callable[..., Any]) -> Any:
    """``call(args)``, with the FSDP2-sharded modules ``f`` reaches gathered around it."""
    if _states() is None or torch.compiler.is_compiling() or tracing():
        return call(args)
    found = _fsdp()
    if found is None or getattr(_LOCAL, "busy", False):
        return call(args)
    _LOCAL.busy = True
    try:
        return _around(f, args, call, found)
    finally:
        _LOCAL.busy = False


def _around(
    f: Callable[..., Any], args: tuple[Any, ...], call: Callable[..., Any], found: Any
) -> Any:
    kind, training = found
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    roots = [f, *(a for a in args if not isinstance(a, (Ragged, torch.Tensor)))]
    pairs = []
    seen: set[int] = set()
    for module in reachable(roots, kind):
        state = _get_module_fsdp_state(module)
        if state is None or id(state) in seen or id(state) in _ACTIVE:
            continue
        seen.add(id(state))
        if state._training_state == training.IDLE:  # not inside its own forward/backward
            pairs.append((module, state))
    if not pairs:
        return call(args)
    scope = _Gathered(pairs, training)
    try:
        out = call(scope.enter(args))
    except BaseException:
        scope.leave((), False)  # reshard, leave FSDP2's states idle
        raise
    return scope.leave(out, True)


class _Gathered:
    def __init__(self, pairs: list[Any], training: Any) -> None:
        self.pairs = pairs
        self.training = training
        self.entered: list[Any] = []

    def enter(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        leaves, spec, where = _grad_tensors(args)
        tensors = tuple(
            leaves[i].values if isinstance(leaves[i], Ragged) else leaves[i] for i in where
        )
        for module, state in self.pairs:
            # FSDP2's own pre-forward (all-gather), given no inputs: it would cast them
            # to a mixed-precision dtype, which the modules' own hooks inside f do
            state._pre_forward(module, (), {})
            self.entered.append((module, state))
            for group in state._fsdp_param_groups:
                # its post-backward hook on the inputs, as the pre-forward registers it
                tensors = tuple(group._register_post_backward_hook(tensors, {})[0])
            state._training_state = self.training.PRE_BACKWARD  # hooks inside f: benign
            _ACTIVE.add(id(state))
        for i, t in zip(where, tensors, strict=True):
            leaves[i] = leaves[i].with_values(t) if isinstance(leaves[i], Ragged) else t
        return tuple(pytree.tree_unflatten(leaves, spec))

    def leave(self, out: Any, ok: bool) -> Any:
        leaves, spec = pytree.tree_flatten(out, is_leaf=lambda v: isinstance(v, Ragged))
        where = [i for i, v in enumerate(leaves) if isinstance(v, (Ragged, torch.Tensor))]
        tensors = tuple(
            leaves[i].values if isinstance(leaves[i], Ragged) else leaves[i] for i in where
        )
        for module, state in reversed(self.entered):
            _ACTIVE.discard(id(state))
            state._training_state = self.training.FORWARD
            state._post_forward(module, (), ())  # reshard; no output cast (see enter)
            if ok:
                with warnings.catch_warnings():
                    # map's outputs are fresh (a view among them is no in-place target)
                    warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
                    tensors = tuple(state._register_pre_backward_hook(tensors))
        if not ok:
            return out
        for i, t in zip(where, tensors, strict=True):
            leaves[i] = leaves[i].with_values(t) if isinstance(leaves[i], Ragged) else t
        return pytree.tree_unflatten(leaves, spec)


__all__ = ["active", "around", "own_hooks", "reachable"]
