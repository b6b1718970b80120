"""The object ``map_report`` returns."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class MapReport:
    """How ``raggedfn.map`` ran a function on one batch.

    Attributes:
        batched: op name -> number of graph nodes that ran through a batching rule.
        fallback: op name -> why it ran as a per-sample loop instead.
        unbatched: op name -> nodes that did not depend on the samples (run once).
        guards: conditions on ragged sizes the trace relies on (checked per batch).
        attention: per attention call of ``f`` (``scaled_dot_product_attention``), the
            path it took -> number of calls: ``"fused"`` (torch's fused kernels per sample
            or per length bucket, or the varlen custom op when compiled), ``"fused with a
            mask"`` (the same with each sample's slice of ``f``'s ``attn_mask``),
            ``"fused, lazy mask: causal"``, ``"fused, lazy mask: dropped"`` and ``"fused,
            lazy mask: per sample"`` (a mask built from positions alone, never
            materialized: every sample causal, so ``is_causal``; True everywhere, so no
            mask; else one call per sample with its own mask), ``"pair
            formulation"`` (every (query, key) pair's logit held in memory: compiled
            inside a ``torch.func`` transform, or a mask the fused paths cannot take; it
            warns eagerly when estimated slower than padding), ``"per sample"`` (the
            node's per-sample loop; its reason is in ``fallback``).
        whole_loop: why the whole function ran per sample, or None.
        partial_loop: why some samples ran per sample (their sizes fail every
            trace's guards) while the others ran batched, or None.
        traces: how many times ``f`` (its code) has been traced so far.
        trace_seconds: time spent tracing this signature (when it was traced).
        output: the result of the call.
        structure: per flat output, its ragged per-sample axes as ``f``'s trace
            decides them (the same for every batch); None when tracing stopped
            before the end and the per-sample loop's outputs decide (an axis is
            ragged where its sizes differ between samples or equal an input's
            ragged size in every sample).

    Examples:
        >>> import torch, raggedfn
        >>> x = raggedfn.from_list([torch.ones(2, 3), torch.ones(4, 3)])
        >>> report = raggedfn.map_report(lambda t: torch.flip(t, [0]).sum(0), x)
        >>> report.fallback
        {'aten.flip.default': 'no batching rule'}
        >>> report.batched
        {'aten.sum.dim_IntList': 1}
        >>> report.output.shape
        torch.Size([2, 3])
    """

    batched: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback: dict[str, str] = dataclasses.field(default_factory=dict)
    unbatched: dict[str, int] = dataclasses.field(default_factory=dict)
    attention: dict[str, int] = dataclasses.field(default_factory=dict)
    guards: list[str] = dataclasses.field(default_factory=list)
    whole_loop: str | None = None
    partial_loop: str | None = None
    traces: int = 0
    trace_seconds: float = 0.0
    output: Any = None
    structure: list[tuple[int, ...]] | None = None

    @property
    def fully_batched(self) -> bool:
        """True when no per-sample loop ran."""
        return self.whole_loop is None and self.partial_loop is None and not self.fallback

    def __str__(self) -> str:
        lines = ["raggedfn.map report"]
        if self.whole_loop is not None:
            lines.append(f"  whole function ran per sample: {self.whole_loop}")
        elif self.partial_loop is not None:
            lines.append(f"  some samples ran per sample: {self.partial_loop}")
        lines.append(f"  traces of f so far: {self.traces}")
        lines.append(f"  trace time: {self.trace_seconds:.3f} s")
        if self.guards:
            lines.append("  guards on sizes: " + ", ".join(self.guards))
        if self.batched:
            lines.append("  batched:")
            lines.extend(f"    {name} x{n}" for name, n in sorted(self.batched.items()))
        if self.fallback:
            lines.append("  per-sample loop (no batching rule):")
            lines.extend(f"    {name}: {why}" for name, why in sorted(self.fallback.items()))
        if self.attention:
            lines.append("  attention paths:")
            lines.extend(f"    {path} x{n}" for path, n in sorted(self.attention.items()))
        if self.unbatched:
            lines.append("  shared (ran once): " + ", ".join(sorted(self.unbatched)))
        return "\n".join(lines)

    __repr__ = __str__
