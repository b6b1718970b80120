"""The plans of a variant: the first trace of ``f``, the probe trace on small sizes, and
the output structure they agree on (which axes of each output are ragged)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._errors import RaggedError, fail
from ..base._sizes import Sz
from ..base._steps import Plan, TSpec
from ..running._fallback import output_specs
from ..running._split import ragged_positions_of
from ..tracing._deps import walk
from ..tracing._trace import HINTS, trace
from ._cache import Variant


def new_variant(
    f: Any,
    roots: list[tuple[Any, str]],
    static: tuple[Any, ...],
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    classes: tuple[int, ...],
) -> tuple[Variant, list[Any], bool]:
    """Walk what ``f`` reads and trace a first plan; ``(variant, lifted, cacheable)``."""
    deps = walk(roots)
    lifted: list[Any] = [None] * len(deps.lifted)
    if not deps.check(*(r for r, _ in roots), lifted):
        raise fail("map", "the state f reads changed while it was being read")
    variant = Variant(static, deps)
    hints = tuple(HINTS[c % len(HINTS)] for c in range(len(classes)))
    plan = trace_plan(f, leaves, kinds, treespec, classes, hints, deps)
    probe_hints = _probe_hints(len(classes))
    needed = not (isinstance(plan, Plan) and _holds_at(plan, classes, probe_hints))
    variant.structure, probe = _structure(
        plan,
        (lambda: trace_plan(f, leaves, kinds, treespec, classes, probe_hints, deps))
        if needed
        else None,
        lambda: trace_plan(f, leaves, kinds, treespec, classes, _large_again(hints), deps),
    )
    if isinstance(plan, Failure):
        variant.failure = plan.reason
        if plan.specs is not None and plan.out_spec is not None:
            variant.empty = (plan.specs, plan.out_spec)
        return variant, lifted, True
    variant.plans.append(plan)
    if isinstance(probe, Plan) and not probe.unknown:
        variant.plans.append(probe)  # a plan for small samples, traced anyway
    return variant, lifted, not plan.unknown


# example sizes of the probe trace: small (below the thresholds of most branches on
# sizes, ``t[:min(3, n)]``), distinct per size class, and never 0 or 1 (torch's own
# special cases)
def _probe_hints(count: int) -> tuple[int, ...]:
    return tuple(2 + c for c in range(count))


def _large_again(hints: tuple[int, ...]) -> tuple[int, ...]:
    """Other, larger example sizes (each first hint times three plus one): a trace pinned
    by ``len(t)`` is traced again on these to tell which of its fixed output sizes follow
    the sample's (where the probe on small sizes stops, or gives the same sizes)."""
    return tuple(3 * h + 1 for h in hints)


def _holds_at(plan: Plan, classes: tuple[int, ...], hints: tuple[int, ...]) -> bool:
    """Whether every guard of ``plan`` holds with these example sizes per size class
    (then a trace on them takes the same branches, and adds nothing), never for a
    pinned trace."""
    if plan.pinned:
        return False
    env = hint_env(plan, classes, hints)
    try:
        return all(bool(evaluate(env)) for _, evaluate in plan.guards)
    except Exception:  # a size this env lacks: trace to find out
        return False


def hint_env(plan: Plan, classes: tuple[int, ...], hints: tuple[int, ...]) -> dict[str, Any]:
    """Symbol name of each ragged axis of ``plan`` -> the example size of its class."""
    env: dict[str, Any] = {}
    axis = 0
    for kind in plan.leaf_kinds:
        for name in kind.symbols:
            env[name] = hints[classes[axis]]
            axis += 1
    return env


def _structure(
    plan: Plan | Failure,
    probe: Callable[[], Plan | Failure] | None,
    again: Callable[[], Plan | Failure] | None = None,
) -> tuple[list[tuple[int, ...]] | None, Plan | Failure | None]:
    """The ragged axes of each output, as f gives them (None when the trace stopped
    before its end), and the probe trace when one ran.

    The first trace's example sizes are large. Where a guard fixed a ragged size
    (``len(t)``, ``float(n)``) or f branches on sizes (``t[:min(3, n)]`` has 3 rows
    for every n >= 3), its fixed output sizes may still follow the input's: a probe
    trace on small sizes tells them apart (axes ragged there, or of other sizes,
    are ragged). Where that probe stops early (``t[4]``) and a guard fixed a size,
    ``again`` traces on other large sizes instead; where none tells and an output
    has a fixed-size axis, the structure is unknown (None). The structure depends on
    f only, never on a batch."""
    specs, pinned, guarded = _specs(plan)
    if specs is None:
        return None, None
    positions = [set(ragged_positions_of(s)) for s in specs]
    if probe is None or not (pinned or guarded):
        return [tuple(sorted(p)) for p in positions], None
    other = probe()
    more, _, _ = _specs(other)
    if (more is None or len(more) != len(specs)) and pinned and again is not None:
        more, _, _ = _specs(again())
    if more is None or len(more) != len(specs):
        # the probe stopped early: a pinned trace cannot tell, nor can a guarded one
        # with a fixed-size output axis (``h[-1:2]`` has no rows for every n >= 3 and
        # one at n = 2, where a branch on the data stops the probe); else the first's
        unknown = pinned or any(_fixed_axis(s) for s in specs)
        return (None if unknown else [tuple(sorted(p)) for p in positions]), other
    _union(positions, specs, more)
    if pinned and again is not None:
        # both example sizes may give the same fixed size where the output follows the
        # sample's past them (t[2:-3] has no rows for n <= 5): a third, larger size
        third, _, _ = _specs(again())
        if third is not None and len(third) == len(specs):
            _union(positions, specs, third)
    return [tuple(sorted(p)) for p in positions], other


def _fixed_axis(spec: Any) -> bool:
    return isinstance(spec, TSpec) and any(not isinstance(s, Sz) for s in spec.shape)


def _union(positions: list[set[int]], specs: list[Any], more: list[Any]) -> None:
    """Add to ``positions`` the axes ragged in ``more`` or of other sizes than in ``specs``."""
    for p, a, b in zip(positions, specs, more, strict=True):
        if isinstance(a, TSpec) and isinstance(b, TSpec) and len(a.shape) == len(b.shape):
            p.update(ragged_positions_of(b))
            p.update(q for q, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y)


def _specs(plan: Plan | Failure) -> tuple[list[Any] | None, bool, bool]:
    if isinstance(plan, Plan):
        return output_specs(plan), plan.pinned, bool(plan.guards)
    return plan.specs, plan.pinned, plan.guarded


@contextlib.contextmanager
def _quiet_meta() -> Iterator[None]:
    """torch's fake tensors log an ERROR for a meta function that raises (``amax`` of an
    empty example); a retry that fails is reported by the first trace's reason."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def trace_plan(
    f: Any,
    leaves: list[Any],
    kinds: list[str],
    treespec: Any,
    classes: tuple[int, ...],
    hints: tuple[int, ...],
    deps: Any,
) -> Plan | Failure:
    try:
        # trace outside any torch.func transform the call runs under
        with torch._C._DisableFuncTorch(), torch.enable_grad():
            return trace(f, leaves, kinds, treespec, classes, hints, deps.lifted_ids)
    except RaggedError:
        raise
    except Exception as error:  # data-dependent control flow, unsupported graph, ...
        first_error = error
    if 0 in hints:  # an empty example: its samples take the empty-sample way (_groups)
        return _failure(first_error)
    try:
        # sizes reasoned about obliviously can fail where every sample runs: ``t[:1] * t``
        # broadcasts Min(1, N) rows against N only if N >= 1 is decided. Again on the
        # example's sizes: each decision is a guard checked per sample
        with torch._C._DisableFuncTorch(), torch.enable_grad(), _quiet_meta():
            return trace(
                f, leaves, kinds, treespec, classes, hints, deps.lifted_ids, oblivious=False
            )
    except RaggedError:
        raise
    except Exception:  # the first trace's reason is the one to report
        return _failure(first_error)


def _failure(error: Exception) -> Failure:
    first = str(error).splitlines()[0] if str(error) else ""
    reason = f"tracing failed: {type(error).__name__}: {first}"[:500]
    return Failure(
        reason,
        getattr(error, "specs", None),
        getattr(error, "pinned", False),
        getattr(error, "guarded", False),
        getattr(error, "out_spec", None),
    )


@dataclasses.dataclass
class Failure:
    """Why ``f`` could not be traced; ``specs``: the output structure when the trace
    completed but cannot run batched (an in-place write into an argument, ...)."""

    reason: str
    specs: list[Any] | None
    pinned: bool = False
    guarded: bool = False
    out_spec: Any = None
