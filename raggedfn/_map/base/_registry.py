"""The table of batching rules, filled by the modules of ``rules``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

RULES: dict[Any, Callable[..., Any]] = {}


def rule(*targets: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(ctx, step, *args, **kwargs)`` as the batching rule of ``targets``.

    A target is an ``OpOverload`` (one overload) or an ``OpOverloadPacket``
    (every overload of the op).
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for target in targets:
            RULES[target] = fn
        return fn

    return register


def find_rule(target: Any) -> Callable[..., Any] | None:
    if getattr(target, "_schema", None) is not None:
        schema_args(target)  # read now, eagerly: a compiled run only looks it up
    found = RULES.get(target)
    if found is None:
        found = RULES.get(getattr(target, "overloadpacket", None))
    if found is None and _is_pointwise(target):
        found = RULES.get("pointwise")
    return found


# target -> ((name, kwarg_only, has_default, default), ...): plain Python, filled when a
# trace finds the rule of a step (eagerly, also for a trace made while dynamo compiles),
# so a rule binding its arguments inside torch.compile never touches the pybind schema
# (dynamo cannot iterate it: "missing tp_iter")
SCHEMA_ARGS: dict[Any, tuple[tuple[str, bool, bool, Any], ...]] = {}


def schema_args(target: Any) -> tuple[tuple[str, bool, bool, Any], ...]:
    """``(name, kwarg_only, has_default, default)`` of each argument of an op's schema."""
    if torch.compiler.is_compiling():
        # a constant to dynamo: its view of the table is taken at its first read, and a
        # trace made later in the same compile (a second map in the region) fills it
        return _schema_args_now(target)
    return _schema_args(target)


@torch._dynamo.assume_constant_result
def _schema_args_now(target: Any) -> tuple[tuple[str, bool, bool, Any], ...]:
    return _schema_args(target)


def _schema_args(target: Any) -> tuple[tuple[str, bool, bool, Any], ...]:
    found = SCHEMA_ARGS.get(target)
    if found is None:
        found = tuple(
            (
                a.name,
                a.kwarg_only,
                a.has_default_value(),
                a.default_value if a.has_default_value() else None,
            )
            for a in target._schema.arguments
        )
        SCHEMA_ARGS[target] = found
    return found


def scalar_slots(target: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of each argument of an op's schema that takes no tensor
    (position -1 for a keyword-only one); read outside dynamo's view as above."""
    if torch.compiler.is_compiling():
        return _scalar_slots_now(target)
    return _scalar_slots(target)


@torch._dynamo.assume_constant_result
def _scalar_slots_now(target: Any) -> tuple[tuple[int, str], ...]:
    return _scalar_slots(target)


SCALAR_SLOTS: dict[Any, tuple[tuple[int, str], ...]] = {}


def _scalar_slots(target: Any) -> tuple[tuple[int, str], ...]:
    found = SCALAR_SLOTS.get(target)
    if found is None:
        found = tuple(
            (-1 if a.kwarg_only else i, a.name)
            for i, a in enumerate(target._schema.arguments)
            if "Tensor" not in str(a.type)
        )
        SCALAR_SLOTS[target] = found
    return found


def _is_pointwise(target: Any) -> bool:
    import torch

    tags = getattr(target, "tags", ())
    name = getattr(target, "_overloadname", "")
    schema = getattr(target, "_schema", None)
    mutates = schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )
    return torch.Tag.pointwise in tags and not mutates and name != "out"


def op_name(target: Any) -> str:
    """Readable name of a graph target, e.g. ``aten.linear.default``."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return f"aten.{schema.name.split('::')[-1]}.{target._overloadname}"
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{name}" if module else name
