"""What a trace of ``f`` depends on besides its arguments, and how to re-read it.

Before tracing, :func:`walk` follows everything ``f`` can reach without receiving it
as an argument: closure cells, the globals its code names (and those of the user
functions it calls by name), defaults, bound ``self``, ``functools.partial``
pieces, and the attributes of modules and plain objects found there. Every value
on the way becomes one node of a :class:`Deps`:

- a tensor becomes a *lifted input*: the trace uses it through a slot that is
  filled afresh at every call (what is checked is its metadata: shape, dtype,
  device, layout, ``requires_grad``; never its identity or contents), so
  rebinding ``W = W - lr * g`` or ``load_state_dict(..., assign=True)`` does not
  trace again;
- a Python number, string, bool, ``None``, dtype, device, enum member... is
  compared by value (``module.training``, a temperature, a global constant);
- a function is compared by its code object; containers by type, length and
  keys; other objects by type, then attribute by attribute.

The nodes compile (:mod:`._deps_check`) into one straight-line Python function
(``Deps.check``) that re-reads every path from the roots and fills the lifted
slots: a warm call pays one small function call per node, no dict walking.

What is *not* followed (documented in docs/map.md): library code (functions and
modules of torch, the standard library, installed packages and raggedfn itself)
is compared by identity only; containers longer than :data:`MAX_ITEMS` and
objects deeper than :data:`MAX_DEPTH` are compared by identity and length.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import math
import sys
import sysconfig
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._deps_check import COMPILED, EAGER, HOOKS, MODULE_HOOKS, TABLE, TYPED, always, compile_check

MAX_ITEMS = 256
MAX_DEPTH = 10
MAX_NODES = 20000

# values compared by equality (their type first)
_SCALARS = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
    range,
    slice,
)
# entries of a module's __dict__ that never change what its forward computes
_MODULE_SKIP = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_version",
    }
)

# the state of torch's composable APIs (FSDP2's ``fully_shard``: gathered or not,
# training state, streams): bookkeeping around the forward, changing at every call
_COMPOSABLE = "__composable_api_state_key"


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(sys.prefix)
    roots.add(sys.base_prefix)
    import raggedfn

    roots.add(raggedfn.__path__[0])
    return tuple(sorted(r.rstrip("/") + "/" for r in roots if r))


_LIBRARY: tuple[str, ...] | None = None


def is_library_file(filename: str) -> bool:
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _library_roots()
    return filename.startswith(_LIBRARY) or filename.startswith("<frozen")


def _is_library_function(fn: types.FunctionType) -> bool:
    return is_library_file(fn.__code__.co_filename)


def _is_library_module(module: types.ModuleType) -> bool:
    filename = getattr(module, "__file__", None)
    return filename is None or is_library_file(filename)


def _is_library_class(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    return module is None or _is_library_module(module)


_OPAQUE = (
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
)


@functools.cache
def _code_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """``(globals, attributes)``: the global names a code object (and the code
    objects nested in it) loads, and the attribute names it reads."""
    globs: set[str] = set()
    attrs: set[str] = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            globs.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            attrs.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_globs, inner_attrs = _code_names(const)
            globs |= inner_globs
            attrs |= inner_attrs
    return frozenset(globs), frozenset(attrs)


@dataclasses.dataclass
class Lifted:
    """A tensor ``f`` captures: where it was found and what it looked like."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layout: torch.layout
    requires_grad: bool


class Deps:
    """The nodes of one walk and the compiled check over them."""

    def __init__(self, num_roots: int) -> None:
        self.num_roots = num_roots
        self.lines: list[str] = []
        self.names: dict[str, Any] = {"_Tensor": Tensor, "_isnan": math.isnan}
        self.lifted: list[Lifted] = []
        self.lifted_ids: dict[int, list[int]] = {}  # id(tensor) -> lifted slots
        self.count = 0
        self.truncated: list[str] = []
        self.check: Callable[..., bool] = always
        self.compiled_check: Callable[..., bool] = always
        self.compiled_lean: Callable[..., bool] = always

    def const(self, value: Any) -> str:
        name = f"K{len(self.names)}"
        self.names[name] = value
        return name

    def node(self, parent: str, access: str) -> str:
        self.count += 1
        var = f"v{self.count}"
        self.lines.append(f"{var} = {parent}{access}")
        return var

    def require(self, condition: str) -> None:
        self.lines.append(f"if not ({condition}): return False")

    def empty_hooks(self, start: int) -> None:
        """The lines from ``start`` on check an empty hook dictionary: left out of
        :attr:`compiled_lean` (the check where dynamo skips empty hooks' guards)."""
        for i in range(start, len(self.lines)):
            if not self.lines[i].startswith(HOOKS):
                self.lines[i] = HOOKS + self.lines[i]

    def finish(self) -> None:
        roots, names = self.num_roots, self.names
        self.check, self.source = compile_check(self.lines, roots, names, compiled=False)
        # for use inside torch.compile: closure cells and globals are read through
        # helpers that also work on functions dynamo made in the compiled region
        self.compiled_check = compile_check(self.lines, roots, names, compiled=True)[0]
        self.compiled_lean = self.compiled_check
        if any(line.startswith(HOOKS) for line in self.lines):
            lean = [line for line in self.lines if not line.startswith(HOOKS)]
            self.compiled_lean = compile_check(lean, roots, names, compiled=True)[0]


class _Walker:
    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.stack: set[int] = set()

    def walk(self, var: str, value: Any, path: str, depth: int) -> None:
        deps = self.deps
        if isinstance(value, Tensor):
            self._tensor(var, value, path)
            return
        kind = type(value)
        if kind in _SCALARS or isinstance(value, enum.Enum):
            self._equal(var, value)
            return
        if depth > MAX_DEPTH or deps.count > MAX_NODES:
            deps.truncated.append(path)
            deps.require(f"{var} is {deps.const(value)}")
            return
        if isinstance(value, type) and not _is_library_class(value):
            deps.require(f"{var} is {deps.const(value)}")
            self._class(f"{var}", value, path, depth)
            return
        if id(value) in self.stack or isinstance(value, _OPAQUE):
            deps.require(f"{var} is {deps.const(value)}")
            return
        self.stack.add(id(value))
        try:
            self._compound(var, value, path, depth)
        finally:
            self.stack.discard(id(value))

    def _equal(self, var: str, value: Any) -> None:
        deps = self.deps
        if value is None or type(value) is bool:
            # a singleton: identity is type and value at once (inside torch.compile one
            # guard, where ``type(v) is bool and v == True`` installs two)
            deps.require(f"{var} is {value!r}")
            return
        t = deps.const(type(value))
        if type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value)):
            # a literal: dynamo reads a number in a global as a graph input under
            # dynamic=True (a float there restarts the analysis, see _dynamo_reads.static)
            k = repr(value)
        else:
            k = deps.const(value)
        # compiled, the type is read from dynamo's guard on the value, which compares
        # the type too (one guard, not a type and a value guard: ``TYPED``)
        typed = TYPED if type(value) in (int, float, complex, str, bytes) else ""
        if isinstance(value, float) and math.isnan(value):
            deps.lines.append(f"{typed}if not (type({var}) is {t} and _isnan({var})): return False")
        else:
            if isinstance(value, float):
                # compiled: a constant to dynamo, not a graph input (see _dynamo_reads.static)
                deps.lines.append(f"{COMPILED}{var} = _static({var})")
            deps.lines.append(f"{typed}if not (type({var}) is {t} and {var} == {k}): return False")

    def _tensor(self, var: str, value: Tensor, path: str) -> None:
        deps = self.deps
        slot = len(deps.lifted)
        deps.lifted.append(
            Lifted(
                path,
                tuple(int(d) for d in value.shape),
                value.dtype,
                value.device,
                value.layout,
                bool(value.requires_grad),
            )
        )
        deps.lifted_ids.setdefault(id(value), []).append(slot)
        deps.require(
            f"isinstance({var}, _Tensor) and {var}.shape == {deps.const(value.shape)} "
            f"and {var}.dtype is {deps.const(value.dtype)} "
            f"and {var}.device == {deps.const(value.device)} "
            f"and {var}.layout is {deps.const(value.layout)}"
        )
        # eager only: dynamo reports requires_grad=False for tensors a torch.func
        # transform wraps inside the compiled region, and guards autograd state itself
        deps.lines.append(
            f"{EAGER}if not ({var}.requires_grad is {value.requires_grad!r}): return False"
        )
        deps.lines.append(f"lifted[{slot}] = {var}")

    def _compound(self, var: str, value: Any, path: str, depth: int) -> None:
        deps = self.deps
        composable = sys.modules.get("torch.distributed._composable_state")
        if composable is not None and isinstance(value, composable._State):
            # FSDP2's state (reached through its hooks): gathered or not, streams,
            # training state; one object per sharded module, bookkeeping only
            deps.require(f"{var} is {deps.const(value)}")
            return
        kind = type(value)
        deps.require(f"type({var}) is {deps.const(kind)}")
        if not _is_library_class(kind) and not isinstance(value, types.FunctionType):
            self._class(f"type({var})", kind, f"type({path})", depth)
        if isinstance(value, types.FunctionType):
            self._function(var, value, path, depth)
        elif isinstance(value, types.MethodType):
            self.walk(deps.node(var, ".__self__"), value.__self__, f"{path}.__self__", depth + 1)
            self.walk(deps.node(var, ".__func__"), value.__func__, path, depth + 1)
        elif isinstance(value, functools.partial):
            self.walk(deps.node(var, ".func"), value.func, f"{path}.func", depth + 1)
            self._sequence(deps.node(var, ".args"), value.args, f"{path}.args", depth)
            self._mapping(deps.node(var, ".keywords"), value.keywords, f"{path}.keywords", depth)
        elif isinstance(value, (tuple, list)):
            self._sequence(var, value, path, depth)
        elif isinstance(value, dict):
            self._mapping(var, value, path, depth)
        elif isinstance(value, torch.nn.Module):
            self._module(var, value, path, depth)
        elif _is_numpy(value):
            deps.require(f"{var} is {deps.const(value)}")
            deps.require(f"{var}.tobytes() == {deps.const(value.tobytes())}")
        elif isinstance(value, (set, frozenset)):
            if len(value) > MAX_ITEMS:
                deps.require(f"{var} is {deps.const(value)}")
                deps.truncated.append(path)
            deps.require(f"{var} == {deps.const(frozenset(value))}")
        elif hasattr(value, "__dict__") or hasattr(type(value), "__slots__"):
            self._object(var, value, path, depth)
        else:
            deps.require(f"{var} is {deps.const(value)}")

    def _function(self, var: str, fn: types.FunctionType, path: str, depth: int) -> None:
        deps = self.deps
        deps.require(f"{var}.__code__ is {deps.const(fn.__code__)}")
        if _is_library_function(fn):
            deps.require(f"{var} is {deps.const(fn)}")
            return
        code = fn.__code__
        for i, (name, cell) in enumerate(zip(code.co_freevars, fn.__closure__ or (), strict=True)):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                continue
            node = deps.node(var, f"@CELL({i})")
            self.walk(node, contents, name, depth + 1)
        for i, default in enumerate(fn.__defaults__ or ()):
            node = deps.node(var, f".__defaults__[{i}]")
            self.walk(node, default, f"{fn.__name__} default {i}", depth + 1)
        for name, default in (fn.__kwdefaults__ or {}).items():
            node = deps.node(var, f".__kwdefaults__[{name!r}]")
            self.walk(node, default, f"{fn.__name__} default {name}", depth + 1)
        names, attributes = _code_names(code)
        globs = fn.__globals__
        for name in sorted(names):
            if name not in globs:
                continue
            value = globs[name]
            node = deps.node(var, f"@GLOBAL({name!r})")
            if isinstance(value, types.ModuleType):
                deps.require(f"{node} is {deps.const(value)}")
                if not _is_library_module(value):
                    # module.NAME read through a user module: follow the named attributes
                    for attr in sorted(attributes & set(vars(value))):
                        sub = deps.node(node, f".__dict__[{attr!r}]")
                        self.walk(sub, vars(value)[attr], f"{name}.{attr}", depth + 1)
                continue
            self.walk(node, value, name, depth + 1)

    def _class(self, var: str, cls: type, path: str, depth: int) -> None:
        """Methods and class attributes of a user-defined class (and its user bases)."""
        deps = self.deps
        if id(cls) in self.stack:
            return
        self.stack.add(id(cls))
        try:
            for i, klass in enumerate(cls.__mro__):
                if _is_library_class(klass):
                    continue
                table = deps.node(var, f".__mro__[{i}].__dict__")
                for name, attr in vars(klass).items():
                    if name.startswith("__") and name.endswith("__") and name != "__call__":
                        continue
                    if isinstance(attr, (staticmethod, classmethod)):
                        attr = attr.__func__
                        node = deps.node(table, f"[{name!r}].__func__")
                    elif isinstance(attr, property):
                        if attr.fget is None:
                            continue
                        attr = attr.fget
                        node = deps.node(table, f"[{name!r}].fget")
                    else:
                        node = deps.node(table, f"[{name!r}]")
                    self.walk(node, attr, f"{klass.__name__}.{name}", depth + 1)
        finally:
            self.stack.discard(id(cls))

    def _sequence(self, var: str, value: Any, path: str, depth: int) -> None:
        deps = self.deps
        if len(value) > MAX_ITEMS:
            deps.require(f"{var} is {deps.const(value)} and len({var}) == {len(value)}")
            deps.truncated.append(path)
            return
        deps.require(f"len({var}) == {len(value)}")
        for i, item in enumerate(value):
            self.walk(deps.node(var, f"[{i}]"), item, f"{path}[{i}]", depth + 1)

    def _mapping(self, var: str, value: dict[Any, Any], path: str, depth: int) -> None:
        deps = self.deps
        if len(value) > MAX_ITEMS:
            deps.require(f"{var} is {deps.const(value)} and len({var}) == {len(value)}")
            deps.truncated.append(path)
            return
        keys = tuple(value)
        deps.require(f"tuple({var}) == {deps.const(keys)}")
        for key in keys:
            node = deps.node(var, f"[{deps.const(key)}]")
            self.walk(node, value[key], f"{path}[{key!r}]", depth + 1)

    def _module(self, var: str, module: torch.nn.Module, path: str, depth: int) -> None:
        deps = self.deps
        state = vars(module)
        for name in sorted(state, key=str):
            if name in _MODULE_SKIP or str(name).startswith(_COMPOSABLE):
                continue
            start = len(deps.lines)
            node = deps.node(var, f".__dict__[{name!r}]")
            self.walk(node, state[name], f"{path}.{name}", depth + 1)
            if name in MODULE_HOOKS and not state[name]:
                deps.empty_hooks(start)
        for group in ("_parameters", "_buffers", "_modules"):
            table = state.get(group, {})
            node = deps.node(var, f".{group}")
            keys = tuple(table)
            # compiled: one guard per dict (``TABLE``); nn.Module names are strings
            mark = TABLE if all(type(k) is str and "'" not in k for k in keys) else ""
            deps.lines.append(f"{mark}if not (tuple({node}) == {deps.const(keys)}): return False")
            for name, item in table.items():
                sub = deps.node(node, f"[{name!r}]")
                deps.lines[-1] = mark + deps.lines[-1]
                self.walk(sub, item, f"{path}.{name}", depth + 1)

    def _object(self, var: str, value: Any, path: str, depth: int) -> None:
        deps = self.deps
        state = getattr(value, "__dict__", None)
        if state is not None:
            if len(state) > MAX_ITEMS:
                deps.require(f"{var} is {deps.const(value)}")
                deps.truncated.append(path)
                return
            node = deps.node(var, ".__dict__")
            deps.require(f"tuple({node}) == {deps.const(tuple(state))}")
            for name in tuple(state):
                sub = deps.node(node, f"[{name!r}]")
                self.walk(sub, state[name], f"{path}.{name}", depth + 1)
        for name in _slot_names(type(value)):
            if hasattr(value, name):
                sub = deps.node(var, f".{name}")
                self.walk(sub, getattr(value, name), f"{path}.{name}", depth + 1)


def _slot_names(cls: type) -> list[str]:
    out: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        out.extend(s for s in slots if s not in ("__dict__", "__weakref__") and s.isidentifier())
    return out


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tobytes")


def walk(roots: list[tuple[Any, str]]) -> Deps:
    """The dependencies of ``roots`` (``(value, description)``: ``f`` and the
    non-tensor shared arguments), with their check compiled."""
    deps = Deps(len(roots))
    walker = _Walker(deps)
    for i, (value, path) in enumerate(roots):
        walker.walk(f"r{i}", value, path, 0)
    deps.finish()
    return deps


__all__ = ["Deps", "Lifted", "is_library_file", "walk"]
