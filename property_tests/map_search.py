"""Checking many generated programs with :func:`map_oracle.check`, and shrinking failures.

``run_many`` generates and checks a stream of programs into a :class:`Summary`
(counts per outcome, the failures, a report); ``shrink`` greedily simplifies a failing
program and batch while its outcome stays the same. ``map_runs.run_sharded`` spreads
the same programs over processes; ``python -m property_tests.map_oracle`` is the CLI.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator

import raggedfn
from property_tests.map_oracle import ALLOWED, FAILURES, MapFn, Outcome, check
from property_tests.map_programs import VOCABULARY, Batch, Program, program_stream

# ----- shrinking ----------------------------------------------------------------------------


def _candidates(program: Program, batch: Batch) -> Iterator[tuple[Program, Batch]]:
    sizes = list(batch.sizes)
    for i in range(len(sizes)):
        if len(sizes) > 1:
            yield program, dataclasses.replace(batch, sizes=tuple(sizes[:i] + sizes[i + 1 :]))
    steps = list(program.steps)
    for i in range(len(steps)):
        smaller = Program(program.input_kind, tuple(steps[:i] + steps[i + 1 :]))
        if smaller.kinds() is not None:
            yield smaller, batch
    for i, (name, args) in enumerate(steps):
        domain = VOCABULARY[name].domain
        for a, value in enumerate(args):
            choices = domain[a]
            position = choices.index(value)
            for simpler in dict.fromkeys(choices[:position]):
                new_args = (*args[:a], simpler, *args[a + 1 :])
                yield (
                    Program(program.input_kind, (*steps[:i], (name, new_args), *steps[i + 1 :])),
                    batch,
                )
    square = batch.input_kind == "sq"
    for i, size in enumerate(sizes):
        for k in range(len(size)):
            for smaller_size in dict.fromkeys((0, 1, 2, size[k] - 1)):
                if 0 <= smaller_size < size[k]:
                    new = (
                        (smaller_size,) * 2 if square else (*size[:k], smaller_size, *size[k + 1 :])
                    )
                    yield (
                        program,
                        dataclasses.replace(batch, sizes=tuple([*sizes[:i], new, *sizes[i + 1 :]])),
                    )
            if square:
                break


def shrink(
    program: Program,
    batch: Batch,
    kind: str,
    map_fn: MapFn = raggedfn.map,
    budget: int = 150,
) -> tuple[Program, Batch, Outcome]:
    """Greedily remove samples and steps, simplify arguments and sizes while the
    outcome stays ``kind``; at most ``budget`` checks."""
    best = (program, batch)
    outcome = check(program, batch, map_fn)
    tries = 0
    improved = True
    while improved and tries < budget:
        improved = False
        for candidate in _candidates(*best):
            tries += 1
            result = check(*candidate, map_fn)
            if result.kind == kind:
                best, outcome, improved = candidate, result, True
                break
            if tries >= budget:
                break
    return best[0], best[1], outcome


# ----- many programs ---------------------------------------------------------------------


@dataclasses.dataclass
class Found:
    index: int
    program: Program
    batch: Batch
    outcome: Outcome

    def size(self) -> tuple[int, int, int]:
        rows = sum(max(1, sum(s)) for s in self.batch.sizes)
        return (len(self.program.steps), rows, self.index)

    def core(self) -> str:
        """What a shrunk failure is about: its kind and the steps left."""
        names = ", ".join(name for name, _ in self.program.steps) or "no steps"
        return f"{self.outcome.kind}: {names}"


@dataclasses.dataclass
class Summary:
    seed: int
    programs: int = 0
    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    first: dict[str, int] = dataclasses.field(default_factory=dict)
    found: list[Found] = dataclasses.field(default_factory=list)
    shrunk: list[tuple[Found, Found]] = dataclasses.field(default_factory=list)
    warned: Counter[str] = dataclasses.field(default_factory=Counter)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    shrink_seconds: float = 0.0
    workers: int = 1  # processes that checked the programs (map_runs.run_sharded)

    def failures(self) -> int:
        return sum(self.counts[k] for k in FAILURES)

    def groups(self) -> dict[tuple[str, str], list[Found]]:
        """Failures and refusals by kind and message (numbers left out), in order."""
        out: dict[tuple[str, str], list[Found]] = {}
        for found in self.found:
            key = (found.outcome.kind, _detail_key(found.outcome.detail))
            out.setdefault(key, []).append(found)
        return out

    def report(self, reproducers: bool = True) -> str:
        lines = [
            f"map program generator: seed {self.seed}, {self.programs} programs, "
            f"{self.seconds:.1f} s wall, {self.cpu_seconds:.1f} s CPU"
            + (f" in {self.workers} processes" if self.workers > 1 else "")
            + f" (shrinking {self.shrink_seconds:.1f} s wall); {self.failures()} disagreements",
            "",
            "outcome            count   first program",
        ]
        for kind in (*FAILURES, *ALLOWED):
            if self.counts[kind]:
                lines.append(f"  {kind:16s} {self.counts[kind]:6d}   {self.first[kind]}")
        if self.warned:
            lines.append(
                "\nwarnings (programs): "
                + ", ".join(f"{w} x{n}" for w, n in self.warned.most_common(6))
            )
        groups = self.groups()
        if groups:
            lines.append("\ngroups (kind, message): count, first program")
            for (kind, key), members in sorted(groups.items(), key=lambda kv: kv[1][0].index):
                lines.append(f"  {len(members):5d}  {members[0].index:6d}  {kind}: {key}")
                if reproducers:
                    shortest = min(members, key=Found.size)
                    sizes = [list(s) for s in shortest.batch.sizes]
                    lines.append(f"         shortest: program {shortest.index}, sizes {sizes}")
                    lines.extend(f"         {line}" for line in shortest.program.body())
        if self.shrunk:
            cores: dict[str, list[tuple[Found, Found]]] = {}
            for original, small in self.shrunk:
                cores.setdefault(small.core(), []).append((original, small))
            lines.append(
                f"\nshrunk reproducers ({len(self.shrunk)} failures shrunk, "
                f"{len(cores)} distinct): count, first program, core"
            )
            for core, members in sorted(cores.items(), key=lambda kv: kv[1][0][0].index):
                lines.append(f"  {len(members):4d}  {members[0][0].index:6d}  {core}")
            if reproducers:
                for core, members in sorted(cores.items(), key=lambda kv: kv[1][0][0].index):
                    original, small = members[0]
                    lines.append(
                        f"\n-- {core} (from program {original.index}; sizes "
                        f"{[list(s) for s in small.batch.sizes]}): {small.outcome.detail}"
                    )
                    lines.append(small.program.source() + small.batch.source().rstrip())
        return "\n".join(lines)


def _detail_key(detail: str) -> str:
    """A detail without its per-program numbers, for counting similar failures."""
    return re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e-?\d+)?", "#", detail)[:150]


def _to_shrink(summary: Summary, per_group: int, first: int) -> list[Found]:
    """The shortest ``per_group`` members of every (kind, message) group, and the first
    ``first`` failures in program order (for "how many programs until found")."""
    chosen: dict[int, Found] = {}
    for members in summary.groups().values():
        for found in sorted(members, key=Found.size)[:per_group]:
            chosen[found.index] = found
    for found in summary.found[:first]:
        chosen[found.index] = found
    return sorted(chosen.values(), key=lambda f: f.index)


def run_many(
    seed: int = 0,
    count: int = 2000,
    min_steps: int = 2,
    max_steps: int = 6,
    map_fn: MapFn = raggedfn.map,
    shrink_per_group: int = 1,
    shrink_first: int = 0,
    shrink_budget: int = 40,
    progress: Callable[[str], None] | None = None,
    start: int = 0,
) -> Summary:
    """Generate and check ``count`` programs (from index ``start`` on); then shrink some
    failures (see _to_shrink)."""
    summary = Summary(seed)
    began, cpu = time.perf_counter(), time.process_time()
    for index, program, batch in program_stream(seed, count, min_steps, max_steps, start):
        outcome = check(program, batch, map_fn)
        kind = outcome.kind
        summary.programs += 1
        summary.counts[kind] += 1
        summary.first.setdefault(kind, index)
        for w in dict.fromkeys(w.split(":")[0] for w in outcome.warnings):
            summary.warned[w] += 1
        if kind in FAILURES or kind == "refused":
            summary.found.append(Found(index, program, batch, outcome))
            if progress and kind in FAILURES:  # at once: a long run may be stopped early
                progress(f"program {index}: {kind}: {outcome.detail[:300]}")
        if progress and (index + 1) % 500 == 0:
            progress(
                f"{index + 1} programs, {time.perf_counter() - began:.0f} s: "
                + ", ".join(f"{k} {n}" for k, n in summary.counts.most_common())
            )
    summary.seconds = time.perf_counter() - began
    summary.cpu_seconds = time.process_time() - cpu
    shrink_some(summary, shrink_per_group, shrink_first, shrink_budget, map_fn)
    return summary


def shrink_some(
    summary: Summary, per_group: int, first: int, budget: int, map_fn: MapFn = raggedfn.map
) -> None:
    """Shrink the failures :func:`_to_shrink` picks into ``summary.shrunk``."""
    shrink_start = time.perf_counter()
    for found in _to_shrink(summary, per_group, first):
        kind = found.outcome.kind
        program, batch, outcome = shrink(found.program, found.batch, kind, map_fn, budget)
        summary.shrunk.append((found, Found(found.index, program, batch, outcome)))
    summary.shrink_seconds = time.perf_counter() - shrink_start
