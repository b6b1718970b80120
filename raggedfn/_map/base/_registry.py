"""The table of batching rules, filled by the modules of ``rules``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    found = RULES.get(target)
    if found is None:
        found = RULES.get(getattr(target, "overloadpacket", None))
    if found is None and _is_pointwise(target):
        found = RULES.get("pointwise")
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
