"""Attention masks built inside ``f`` from positions, kept lazy until attention reads them.

transformers builds a boolean ``[N, N]`` mask inside ``f`` from ``arange`` positions
whenever it cannot pass ``is_causal`` (decoders without a cache, sliding windows,
ModernBERT's local layers), once per forward, and hands it to every layer's
``scaled_dot_product_attention``. Batched as it is traced, that mask is a packed pair
state (``sum N_i^2`` elements, a few elementwise ops over it) that attention then reads
per sample, and the fused kernel given an explicit mask computes every block, also the
ones a causal mask hides.

A step is *position-only* when nothing it depends on reads the samples' values: only
sizes, constants made inside ``f`` (``arange``, ``ones``) and other position-only steps
(no input, captured tensor, random op, in-place rebinding or data-dependent size). Its
value for a sample is then a function of that sample's sizes alone. The pair-state steps
(two ragged axes) of that kind whose only readers are other such steps or attention's
``attn_mask`` are *lazy*: running the plan makes a :class:`LazyPairB` (the step and its
resolved arguments) instead of the packed mask. Attention then asks it, per distinct set
of sizes, for one sample's mask, evaluated as the loop evaluates it (each op on that
sample's slices) and classified: the causal triangle becomes ``is_causal=True``, a mask
of only True is dropped, another mask is passed per sample as it is (see
``_attention._lazy``). Classifications and masks are remembered on the plan per sizes
(bounded by :data:`MEMO_BYTES`), so a mask shared by the layers, or seen at earlier calls,
is not evaluated again. Wherever that path does not apply (compiled code, a transform
under compile, large batches with masks that differ per sample) the mask is materialized
by running its steps as before (:meth:`LazyPairB.force`): the same result either way.

``ENABLED = False`` turns the mechanism off (every mask materialized), for comparisons.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..base._sizes import Sz
from ..base._steps import Plan, Step, TSpec, refs
from ..base._values import Ctx

ENABLED = True
MEMO_BYTES = 1 << 26  # masks remembered per plan (classifications cost nothing)

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_T = TypeVar("_T")


def _mask_ref(step: Step) -> Any:
    """The ``attn_mask`` argument of an attention step (a ``Ref`` or anything else)."""
    if step.target is not _SDPA:
        return None
    if len(step.args) > 3:
        return step.args[3]
    return step.kwargs.get("attn_mask")


def _pair_state(out: Any) -> bool:
    return isinstance(out, TSpec) and sum(isinstance(s, Sz) for s in out.shape) >= 2


def _has_tensor(a: Any) -> bool:
    if isinstance(a, Tensor):
        return True
    if isinstance(a, (list, tuple)):
        return any(_has_tensor(v) for v in a)
    if isinstance(a, dict):
        return any(_has_tensor(v) for v in a.values())
    return False


def lazy_steps(plan: Plan) -> frozenset[int]:
    """Value indices of the lazy steps of ``plan`` (computed once per plan)."""
    cached = plan.__dict__.get("_lazy_steps")
    if cached is not None:
        return cached
    count = len(plan.placeholders)
    pure: set[int] = set()
    readers: dict[int, list[tuple[Step, bool]]] = collections.defaultdict(list)
    for step in plan.steps:
        read: set[int] = set()
        refs(step.args, read)
        refs(step.kwargs, read)
        mask = _mask_ref(step)
        others: set[int] = set()
        refs((step.args[:3], {k: v for k, v in step.kwargs.items() if k != "attn_mask"}), others)
        for index in read:
            as_mask = getattr(mask, "index", None) == index and index not in others
            readers[index].append((step, as_mask))
        if step.slot is not None or step.random or step.rebind or step.defines:
            continue
        if step.batched and isinstance(step.out, (Sz, int, float, bool)):
            pure.add(step.index)  # a size (its expression), or the same number for all
        elif all(i >= count and i in pure for i in read) and not _has_tensor(
            (step.args, step.kwargs)
        ):
            pure.add(step.index)
    keep: set[int] = set()
    for o in plan.outputs:
        refs(o, keep)
    for step in plan.steps:
        keep.update(step.rebind or ())
    lazy: set[int] = set()
    for step in reversed(plan.steps):
        index = step.index
        if index not in pure or index in keep or not step.batched or not _pair_state(step.out):
            continue
        found = readers.get(index)
        if found and all(
            (as_mask and step.out.dtype == torch.bool) or reader.index in lazy
            for reader, as_mask in found
        ):
            lazy.add(index)
    out = frozenset(lazy)
    plan._lazy_steps = out  # type: ignore[attr-defined]
    return out


def active() -> bool:
    """Whether lazy masks are made at this call: eagerly, with :data:`ENABLED`."""
    return ENABLED and not torch.compiler.is_compiling()


def outside(found: dict[int, _T], plan: Plan) -> dict[int, _T]:
    """Row chains or blocks of ``plan`` by their first step, less those holding a lazy
    step (their steps run one by one)."""
    if not found or not active() or not (lazy := lazy_steps(plan)):
        return found
    steps = plan.steps
    return {
        k: c
        for k, c in found.items()
        if not any(steps[j].index in lazy for j in getattr(c, "members", ()))
    }


class LazyPairB:
    """A position-only pair state not yet computed: ``step`` on its resolved ``args``.

    ``materialize(args, kwargs)`` runs the step as the plan would (its batching rule).
    """

    def __init__(
        self,
        ctx: Ctx,
        plan: Plan,
        step: Step,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        materialize: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    ) -> None:
        self.ctx = ctx
        self.plan = plan
        self.step = step
        self.args = args
        self.kwargs = kwargs
        self.materialize = materialize
        self._forced: Any = None
        self._samples: dict[int, Any] = {}
        self.kinds: list[Any] | None = None  # per sample, once classified (see classify)

    def force(self) -> Any:
        """The batched value, computed once (its lazy arguments first)."""
        if self._forced is None:
            args, kwargs = forced(self.args, self.kwargs)
            self._forced = self.materialize(args, kwargs)
        return self._forced

    def sample(self, i: int) -> Any:
        """Sample ``i``'s value, each op run on sample ``i``'s arguments as the loop does."""
        found = self._samples.get(i)
        if found is None:
            from ..running._fallback import sample_of

            def one(a: Any) -> Any:
                if isinstance(a, LazyPairB):
                    return a.sample(i)
                if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
                    return type(a)(one(v) for v in a)
                return sample_of(self.ctx, a, i)

            args = tuple(one(a) for a in self.args)
            kwargs = {k: one(v) for k, v in self.kwargs.items()}
            found = self._samples[i] = self.step.target(*args, **kwargs)
        return found


def forced(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every lazy value materialized (in lists too)."""

    def one(a: Any) -> Any:
        if isinstance(a, LazyPairB):
            return a.force()
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            return type(a)(one(v) for v in a) if any(isinstance(v, LazyPairB) for v in a) else a
        return a

    if not any(isinstance(a, (LazyPairB, list, tuple)) for a in (*args, *kwargs.values())):
        return args, kwargs
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _keys(ctx: Ctx) -> list[tuple[int, ...]]:
    """Per sample, its value of every size symbol (what a position-only value depends on)."""
    names = sorted(
        n for n, v in ctx.env.items() if isinstance(v, Tensor) and v.shape == (ctx.batch_size,)
    )
    if not names:
        return [()] * ctx.batch_size
    return [tuple(row) for row in torch.stack([ctx.env[n] for n in names], 1).tolist()]


def classify(mask: LazyPairB) -> list[Any]:
    """Per sample of the batch: ``frozenset`` of the kernel flags its mask stands for
    (``"causal"``: the ``[N, M]`` top-left triangle of SDPA's ``is_causal``; ``"all"``:
    True everywhere), else (``frozenset()``) the sample's mask tensor. One evaluation per
    distinct set of sizes, remembered on the plan."""
    if mask.kinds is not None:
        return mask.kinds
    memo: collections.OrderedDict[Any, Any] = mask.plan.__dict__.setdefault(
        "_lazy_memo", collections.OrderedDict()
    )
    kinds: list[Any] = []
    seen: dict[Any, Any] = {}
    for i, key in enumerate(_keys(mask.ctx)):
        full = (mask.step.index, key)
        found = seen.get(full)
        if found is None:
            found = memo.get(full)
            if found is None:
                found = _classified(mask.sample(i))
                memo[full] = found
                _bound(memo)
            else:
                memo.move_to_end(full)
            seen[full] = found
        kinds.append(found)
    mask.kinds = kinds
    return kinds


def _classified(value: Any) -> Any:
    """``frozenset`` of the flags a sample's boolean mask equals, or the mask itself."""
    if not isinstance(value, Tensor) or value.dtype != torch.bool or value.ndim < 2:
        return value
    n, m = value.shape[-2:]
    flags = set()
    if bool(value.all()):
        flags.add("all")
    triangle = torch.ones(n, m, dtype=torch.bool, device=value.device).tril()
    if torch.equal(value, triangle.expand(value.shape)):
        flags.add("causal")
    return frozenset(flags) if flags else value


def _bound(memo: collections.OrderedDict[Any, Any]) -> None:
    """Drop the oldest remembered masks beyond :data:`MEMO_BYTES`."""
    held = sum(v.numel() for v in memo.values() if isinstance(v, Tensor))
    while held > MEMO_BYTES:
        for key, value in memo.items():
            if isinstance(value, Tensor):
                held -= value.numel()
                del memo[key]
                break


__all__ = ["ENABLED", "LazyPairB", "active", "classify", "forced", "lazy_steps", "outside"]
