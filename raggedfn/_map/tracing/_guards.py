"""Which guards of a trace are checked per sample, and which are torch's layout bookkeeping."""

from __future__ import annotations

import inspect
import types
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch.utils._sympy.functions as symfn
from torch.fx.experimental.symbolic_shapes import ShapeEnv, uninteresting_files

_STRIDE_FRAMES = {
    "check_contiguous_sizes_strides",
    "ge",
    "should_swap",
    "compute_elementwise_output_logical_to_physical_perm",
    "is_non_overlapping_and_dense",
    "_compute_contiguous_strides",
    "is_contiguous",
    "compute_required_storage_length",
    "_reshape_view_helper_core_alg",
    "_reshape_view_helper",
    # validation in reference decompositions (e.g. amax inside logsumexp refuses an
    # empty axis) that the eager per-sample kernel does not perform
    "_reduction",
}


# ... and any torch-internal frame whose function name says it is about layout
_STRIDE_WORDS = (
    "stride",
    "contiguous",
    "view_helper",
    "channels_last",
    "non_overlapping",
    "memory_format",
)


def stride_only(guard: Any) -> bool:
    """Guards that decide strides, contiguity or view-vs-copy only, never values.

    Every other guard is kept and checked per sample: branches in user code,
    broadcasting equalities, slice clamping (``x[:3]`` records ``s0 >= 3``),
    ``narrow`` bounds. The dropped ones come from torch's contiguity and
    reshape-as-view helpers (often ``Ne(s0, 1)``), size-1 special cases inside
    ``matmul``/``einsum`` and other C++ meta functions (``__call__`` frames: a
    size-1 axis squeezed or broadcast gives the same values), and reshape's ``-1``
    inference (a division that is only undefined for empty samples). This list is
    a judgement about torch 2.13's meta code; see docs/map.md.
    """
    loc = getattr(getattr(guard, "sloc", None), "framework_loc", None)
    name = getattr(loc, "name", "") or ""
    line = getattr(loc, "line", "") or ""
    filename = (getattr(loc, "filename", "") or "").replace("\\", "/")
    if "/torch/" not in filename:
        return False  # user code: a real branch
    if name in _STRIDE_FRAMES or "contiguous" in line:
        return True
    if any(word in name for word in _STRIDE_WORDS):
        return True
    expr = guard.expr
    if any(isinstance(a, symfn.Max) and 1 in a.args for a in sympy.preorder_traversal(expr)):
        return True  # Max(1, size) is a stride: a layout decision
    compares_with_one = isinstance(
        expr, (sympy.Ne, sympy.StrictLessThan, sympy.StrictGreaterThan)
    ) and (1 in (expr.lhs, expr.rhs))
    if name == "matmul" and not isinstance(expr, sympy.Eq):
        return True  # the matmul decomposition's reshapes; equalities (broadcasting) stay
    if name in ("__call__", "infer_size", "broadcast_shapes") and compares_with_one:
        # size-1 special cases inside matmul/einsum kernels (squeeze vs broadcast of a
        # size-1 axis gives the same values; equality guards for broadcasting are kept)
        return True
    return isinstance(expr, sympy.Ne) and 0 in (expr.lhs, expr.rhs) and expr.has(symfn.FloorDiv)


class LayoutFreeShapeEnv(ShapeEnv):
    """A ShapeEnv whose layout decisions are never facts.

    ShapeEnv turns every guard into an axiom (and refines ranges with it), so a
    guard dropped as layout bookkeeping would still decide a later comparison in f
    statically, without a guard: a ``Ne(s, 1)`` from matmul's reshape decided
    ``x.shape[0] == 1`` for every sample, and ``Eq(numel, 0)`` from ``contiguous``
    decided ``h.numel() > 0``. Here a decision that :func:`stride_only` calls layout
    is evaluated with guards suppressed (the example's answer, no guard, no fact);
    every other decision is recorded as usual and checked per sample.
    """

    def _get_user_frame(self) -> types.FrameType | None:
        # as torch's, skipping this module too: a guard's location is where f (or
        # torch's own code) asked, never the override below
        skip = uninteresting_files()
        frame = inspect.currentframe()
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename not in skip and filename != __file__:
                return frame
            frame = frame.f_back
        return None

    def evaluate_expr(  # type: ignore[override]
        self,
        orig_expr: Any,
        hint: Any = None,
        fx_node: Any = None,
        size_oblivious: bool = False,
        fallback_value: bool | None = None,
        *,
        forcing_spec: bool = False,
    ) -> Any:
        def evaluate() -> Any:
            return super(LayoutFreeShapeEnv, self).evaluate_expr(
                orig_expr,
                hint,
                fx_node,
                size_oblivious,
                fallback_value,
                forcing_spec=forcing_spec,
            )

        if self._suppress_guards_tls() or getattr(orig_expr, "is_number", True):
            return evaluate()
        if self._maybe_evaluate_static(orig_expr, size_oblivious=size_oblivious) is not None:
            return evaluate()  # decided by true facts: no guard either way
        with self.suppress_guards():
            value = evaluate()
        if value is sympy.true:
            decided = orig_expr
        elif value is sympy.false:
            decided = sympy.Not(orig_expr)
        else:
            decided = sympy.Eq(orig_expr, value)
        if stride_only(types.SimpleNamespace(expr=decided, sloc=self._get_sloc())):
            return value
        return evaluate()


__all__ = ["LayoutFreeShapeEnv", "stride_only"]
