"""The compiled form of a :class:`._deps.Deps`: its lines as one Python function.

A walk records one line per node (``v3 = v1.__dict__['scale']``, ``if not (...): return
False``, ``lifted[0] = v5``); :func:`compile_check` joins them into ``check(r0, ...,
lifted)``, which returns whether every recorded fact still holds and fills the lifted
slots on the way. Closure cells and globals are read directly in the eager check and
through helpers in the compiled one (they also work on functions dynamo made); lines
marked :data:`EAGER` or :data:`COMPILED` belong to one of the two only; lines marked
:data:`HOOKS` (an empty hook dictionary) are left out of the lean compiled check;
lines marked :data:`TYPED` read a number's type from dynamo's value guard when compiled,
and lines marked :data:`TABLE` a module's parameter, buffer and submodule dicts with one
guard each.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ._dynamo_reads import cell, entry_of, exact_type, global_of, keys_of, static


def compile_check(
    lines: list[str], num_roots: int, names: dict[str, Any], compiled: bool
) -> tuple[Callable[..., bool], str]:
    """``(check, its source)`` of a walk's ``lines`` over ``num_roots`` roots, with the
    constants ``names`` in its namespace."""
    roots = ", ".join(f"r{i}" for i in range(num_roots))
    body = "\n        ".join(_accessors(line, compiled) for line in lines) or "pass"
    source = (
        f"def check({roots}{', ' if roots else ''}lifted):\n"
        f"    try:\n        {body}\n"
        f"    except Exception:\n        return False\n"
        f"    return True\n"
    )
    namespace = dict(names)
    if compiled:
        # the constants as closure cells, not globals: dynamo guards every global an
        # inlined function reads, but reads a closure through the function's own
        # source, which for a check reached through ``_compiled._variants`` installs
        # no guard (the constants are fixed for the variant)
        namespace.update(
            _cell=cell,
            _global=global_of,
            _static=static,
            _type=exact_type,
            _keys=keys_of,
            _entry=entry_of,
        )
        params = ", ".join(namespace)
        inner = "\n".join("    " + line for line in source.splitlines())
        source = f"def _make({params}):\n{inner}\n    return check\n"
        scope: dict[str, Any] = {}
        exec(compile(source, "<raggedfn.map guards>", "exec"), scope)
        return scope["_make"](**namespace), source
    exec(compile(source, "<raggedfn.map guards>", "exec"), namespace)
    return namespace["check"], source


_ACCESSOR = re.compile(r"^(v\d+) = (\w+)@(CELL|GLOBAL)\((.*)\)$")


EAGER = "#eager "


COMPILED = "#compiled "


# a line of an empty hook dictionary's check (see ``Deps.compiled_lean``)
HOOKS = "#hooks "

# a line ``if not (type(vN) is KM and ...)`` on a number or string: compiled, the type
# comes from dynamo's guard on the value (``_dynamo_reads.exact_type``), not a guard of
# its own
TYPED = "#typed "

_TYPE_IS = re.compile(r"\btype\((v\d+)\) is (K\d+)")

# a line on a module's parameter, buffer or submodule dict (its keys, or one entry):
# compiled, read through ``_dynamo_reads.keys_of`` / ``entry_of`` (one guard per dict,
# its length, where dynamo's own read guards its type and length)
TABLE = "#table "

_TABLE_KEYS = re.compile(r"\btuple\((v\d+)\) == ")
_TABLE_ENTRY = re.compile(r"^(v\d+) = (v\d+)\[('[^']*')\]$")

# a module's hooks: compared eagerly; inside torch.compile an empty hook dictionary
# (or no full backward hook) is guarded only where dynamo guards the empty hooks of
# the modules it calls itself (``skip_nnmodule_hook_guards`` off): the compiled check
# guards them as torch.compile does a module called directly
MODULE_HOOKS = frozenset(
    {
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_is_full_backward_hook",
    }
)


def _accessors(line: str, compiled: bool) -> str:
    if line.startswith(HOOKS):
        line = line[len(HOOKS) :]
    if line.startswith(TABLE):
        line = line[len(TABLE) :]
        if not compiled:
            return line
        entry = _TABLE_ENTRY.match(line)
        if entry is not None:
            return f"{entry[1]} = _entry({entry[2]}, {entry[3]})"
        return _TABLE_KEYS.sub(r"_keys(\1) == ", line, count=1)
    if line.startswith(TYPED):
        line = line[len(TYPED) :]
        return _TYPE_IS.sub(r"_type(\1, \2)", line, count=1) if compiled else line
    if line.startswith(EAGER):
        return "pass" if compiled else line[len(EAGER) :]
    if line.startswith(COMPILED):
        return line[len(COMPILED) :] if compiled else "pass"
    match = _ACCESSOR.match(line)
    if match is None:
        return line
    var, parent, kind, arg = match.groups()
    if kind == "CELL":
        if compiled:
            return f"{var} = _cell({parent}, {arg})"
        return f"{var} = {parent}.__closure__[{arg}].cell_contents"
    if compiled:
        return f"{var} = _global({parent}, {arg})"
    return f"{var} = {parent}.__globals__[{arg}]"


def always(*args: Any) -> bool:
    """The check of a walk not finished yet."""
    return True
