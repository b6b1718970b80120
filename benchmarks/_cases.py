"""What a benchmark measures: length distributions, cases, steps and suites.

A *suite* (e.g. ``benchmarks.segment_ops``) defines workloads and, for each
workload, one builder per *system* (raggedfn, the padded baseline, torch.nested,
a per-sample loop, ...). A builder prepares inputs outside the timed region and
returns a :class:`Step`: a zero-argument ``run`` that does the timed work and a
``collect`` that turns its output into per-sample tensors, so the harness (and
``tests/test_harness.py``) can check that every system computes the same thing.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

BASELINE = "padded"


@dataclass(frozen=True)
class Distribution:
    """Per-sample lengths drawn with a fixed seed (printed with every result).

    ``sigma`` is the log-space spread of a lognormal with mean ``mean``; ``sigma = 0``
    gives all-equal lengths. Lengths are rounded and clipped to ``[low, high]``.
    """

    name: str
    mean: float
    sigma: float
    low: int
    high: int
    seed: int
    note: str

    def lengths(self, batch: int, scale: float = 1.0) -> list[int]:
        """``batch`` lengths; ``scale`` shrinks them for quick runs and tests."""
        if self.sigma == 0:
            drawn = np.full(batch, self.mean)
        else:
            rng = np.random.default_rng(self.seed)
            mu = math.log(self.mean) - self.sigma**2 / 2
            drawn = rng.lognormal(mu, self.sigma, batch)
        clipped = np.clip(np.round(drawn), self.low, self.high)
        return [max(1, round(float(n) * scale)) for n in clipped]


# seeds picked once so that B = 32 hits the target occupancy (mean / max length)
DISTRIBUTIONS: dict[str, Distribution] = {
    d.name: d
    for d in (
        Distribution("lognormal", 128, 1.0, 16, 512, 30, "high variation, ~25% occupancy"),
        Distribution("medium", 128, 0.45, 16, 512, 12, "medium variation, ~50% occupancy"),
        Distribution("low", 128, 0.12, 16, 512, 37, "low variation, ~80% occupancy"),
        Distribution("equal", 128, 0.0, 16, 512, 0, "all equal, padding is free"),
    )
}


def occupancy(lengths: Sequence[int], power: int = 1) -> float:
    """``sum N^p / (B * max N^p)``: the ideal time ratio of a ``N^p`` workload."""
    if not lengths:
        return 1.0
    return sum(n**power for n in lengths) / (len(lengths) * max(lengths) ** power)


class Missing(Exception):
    """A system cannot run a workload (a public name does not exist yet, eager-only, ...)."""


@dataclass
class Step:
    """What a builder returns: the timed ``run`` and how to read its output per sample."""

    run: Callable[[], Any]
    collect: Callable[[Any], list[torch.Tensor]]
    # per-build facts copied into the cell (e.g. compile_s, graphs of compiled systems)
    extra: dict[str, Any] = field(default_factory=dict)
    # False for a timing reference that computes something else (e.g. the bare torch kernel
    # an op's per-call overhead is compared with): its output is not checked
    checked: bool = True


@dataclass(frozen=True)
class Case:
    """One cell's inputs: workload, mode (``fwd`` / ``fwd+bwd``) and lengths."""

    suite: str
    workload: str
    mode: str
    distribution: str
    lengths: tuple[int, ...]
    params: dict[str, Any] = field(default_factory=dict, hash=False)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int = 0


@dataclass
class Suite:
    """A named set of workloads, systems (builders) and cases."""

    name: str
    workloads: list[str]
    modes: list[str]
    systems: dict[str, Callable[[Case], Step]]
    params: Callable[[bool], dict[str, Any]]
    distributions: Callable[[bool], list[str]]
    ideal_ratio: Callable[[Case], float]
    primary: str = "raggedfn"
    # which cells get a memory subprocess (default: all); heavy suites can skip some
    memory_for: Callable[[Case], bool] | None = None
    # the system every ratio is relative to (timed in every round)
    baseline: str = BASELINE
    # the per-sample outputs every system must give; default: the baseline's output
    expected: Callable[[Case], list[torch.Tensor]] | None = None

    def cases(
        self,
        quick: bool = False,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> list[Case]:
        params = self.params(quick)
        batch = params["batch"]
        scale = params.get("scale", 1.0) if scale is None else scale
        out = []
        for dist in self.distributions(quick):
            lengths = tuple(DISTRIBUTIONS[dist].lengths(batch, scale))
            for workload in self.workloads:
                for mode in self.modes:
                    out.append(
                        Case(self.name, workload, mode, dist, lengths, params, device, dtype)
                    )
        return out

    def build(self, case: Case, system: str) -> Step:
        return self.systems[system](case)


def load_suite(name: str) -> Suite:
    """The ``SUITE`` object of ``benchmarks.<name>``."""
    return importlib.import_module(f"benchmarks.{name}").SUITE
