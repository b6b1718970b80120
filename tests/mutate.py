"""Mutation testing with mutmut, one slice per package, each with its own fast tests.

``make mutate`` runs ``python -m tests.mutate``. Each slice runs in its own copy
of the tracked files under ``build/mutate/<slice>/`` with a ``[tool.mutmut]``
section naming the package to mutate and the slice's fast test selection. The
slice's mutants are generated first (seconds per file); then a random sample of
them, drawn with a fixed seed from every mutant of the slice, is tested: per
mutant mutmut runs only the selection's tests that reach the mutated function,
fastest first, stopping at the first failure, in a process forked from one warm
interpreter (torch is imported once). Verdicts stay cached in the slice's
``mutants/``: a second run re-tests only sampled mutants without a verdict, or
that survived or had no tests (mutmut resets the verdicts of changed functions).

Options (environment, as ``make mutate MUTATE_SLICES=...``):
    MUTATE_SLICES: slices to run, in order (default ``prims ops construct map``).
    MUTATE_SAMPLE: mutants drawn per slice, uniformly without replacement
        (default 60: the 95% interval is about +-8 points at a 90% score), or ``all``.
    MUTATE_SEED: the draw's seed (default 20; the sample of a slice is a function
        of the seed and the sorted mutant names alone).
    MUTATE_JOBS: mutants tested at once per slice (default 1; run under ``nice -n 10``).
    MUTATE_PARALLEL: slices run at once, each in its own process (default 2: on the
        shared 2-core machine the four default slices took 31.5 minutes two at a time at
        load 3-7, and 16 one after another at load 2-4; docs/testing.md).

Prints, per slice, killed / survived / no tests / timeouts, the killed share with
its 95% Wilson interval (an estimate of the score over all the slice's mutants) and
the time taken; writes ``build/mutate/<slice>.txt`` with the diff of every sampled
mutant that was not killed, and ``build/mutate/summary.md`` (the latest run of every slice; slices can run at once as
separate ``make mutate MUTATE_SLICES=...``). Not part of ``make test``.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "mutate"


class Slice(NamedTuple):
    packages: tuple[str, ...]  # mutmut's only_mutate globs
    prefixes: tuple[str, ...]  # mutant names start with one of these
    tests: tuple[str, ...]


SLICES = {
    "prims": Slice(
        ("raggedfn/_prims/*",),
        ("raggedfn._prims.",),
        (
            "tests/test_prims.py",
            "tests/test_prims_bodies.py",
            "tests/test_host_planned_eager.py",
            "tests/test_prims_apply.py",
            "tests/test_forward.py",
            "tests/test_grouped.py",
            "tests/test_segment_matmul_groups.py",
            "tests/test_sdpa_prim.py",
            "tests/test_varlen_prim.py",
            "tests/test_scan.py",
            "tests/test_fast_paths.py",
            # the all_to_all rule on a gloo group of one rank, in this process
            "tests/test_collective_one_rank.py",
            # survivors of the 2026-12-08 draw (logsumexp's shift, varlen's empty axes)
            "tests/test_prims_mutants.py",
        ),
    ),
    "ops": Slice(
        ("raggedfn/ops/*",),
        ("raggedfn.ops.",),
        (
            "tests/test_reduce.py",
            "tests/test_scan.py",
            "tests/test_shape.py",
            "tests/test_select.py",
            "tests/test_elementwise.py",
            "tests/test_nn.py",
            "tests/test_products.py",
            "tests/test_attention.py",
            "tests/test_host_planned_eager.py",
            "tests/test_grouped.py",
            "tests/test_fast_paths.py",
            "tests/test_boundaries.py",
            "tests/test_reduce_defaults.py",
            "tests/test_stable_order.py",
            "tests/test_size_checks.py",
            "tests/test_matmul_ranks.py",
            "tests/test_ops_mutants.py",
            # survivors of the 2026-12-08 draw
            "tests/test_ops_mutants_compare.py",
            "tests/test_ops_mutants_shape.py",
            # the per-sample comparisons of ops live in the property tests
            "property_tests/test_broadcast_props.py",
            "property_tests/test_elementwise_props.py",
            "property_tests/test_mixed_props.py",
            "property_tests/test_nested_props.py",
            # products, cat, gather and masked_select of nested values (_nested_products.py,
            # _nested_select.py, _select's nested levels) are compared with the loop only here
            "property_tests/test_nested_ops_props.py",
            "property_tests/test_nn_props.py",
            "property_tests/test_products_props.py",
            "property_tests/test_reduce_props.py",
            "property_tests/test_select_props.py",
            "property_tests/test_shape_props.py",
            "property_tests/test_softmax_props.py",
        ),
    ),
    "construct": Slice(
        # the constructors: _construct.py and the modules split from it
        ("raggedfn/_construct*.py", "raggedfn/_padded.py"),
        ("raggedfn._construct", "raggedfn._padded."),
        (
            "tests/test_construct.py",
            "tests/test_construct_mutants.py",
            "tests/test_ragged.py",
            "tests/test_interop.py",
            "property_tests/test_construct_props.py",
            # the nested constructors (_construct_nested.py, from_list of lists) are
            # tested only here (about 20 s)
            "property_tests/test_nested_props.py",
            "tests/test_nested_models.py",
        ),
    ),
    "map": Slice(
        ("raggedfn/_map/*", "raggedfn/_map/*/*"),  # the sub-packages, whatever * crosses
        ("raggedfn._map.",),
        (
            "tests/test_map.py",
            "tests/test_map_index.py",
            "tests/test_map_cache.py",
            "tests/test_map_regressions.py",
            "tests/test_map_soundness.py",
            "tests/test_map_mutants.py",
            "tests/test_map_found_paths.py",
            # map's row tiles and sample groups (_tiles.py, _groups.py, _chunks.py) and
            # nested values are tested only here
            "tests/test_map_chunks.py",
            "tests/test_nested_map.py",
            # the warm call's shortcuts and their ways back (_warm.py, _prepared.py,
            # same_rows, make_ctx's memo) are forced only here
            "tests/test_map_warm_call.py",
            "tests/test_map_prepared.py",
            # pair blocks (_blocks.py) and the interpreter shortcuts (added 2026-12-03)
            "tests/test_map_blocks.py",
            "tests/test_map_warm_paths.py",
            # attention's paths and lazy masks (rules/_attention.py, _lazy_pairs.py),
            # nested values (nested/), products, indexing, randomness, empty batches,
            # fixed rows, one-row samples, size probes, user errors, the cache and
            # random programs (about 50 s together; the generated programs run in
            # worker processes, out of mutmut's sight)
            "tests/test_map_attention_paths.py",
            "tests/test_map_lazy_masks.py",
            "tests/test_map_block_softmax.py",
            "tests/test_map_nested_batched.py",
            # a warm eager call over nested values (entry/_eager_nested.py): its key,
            # checks and ways back are forced only here
            "tests/test_nested_map_warm.py",
            "tests/test_map_products.py",
            "tests/test_map_diff.py",
            "tests/test_map_randomness.py",
            "tests/test_map_empty_batch.py",
            "tests/test_map_fixed_rows.py",
            "tests/test_map_one_row.py",
            "tests/test_map_probe_sizes.py",
            "tests/test_map_user_errors.py",
            "tests/test_map_cache.py",
            "property_tests/test_map_props.py",
            # FSDP2 around map (entry/_fsdp.py) in this process: a gloo group of one rank
            "tests/test_map_fsdp_one_rank.py",
            # survivors of the 2026-12-08 draw: the trace's write and alias checks, the
            # running shortcuts, one-sample blocks (the compiled tests of dynamo's readers
            # in test_map_mutants_misc.py are left out with every compiled test: SKIP)
            "tests/test_map_mutants_tracing.py",
            "tests/test_map_mutants_running.py",
            "tests/test_map_mutants_misc.py",
            "tests/test_map_mutants_blocks.py",
            "tests/test_map_mutants_warm.py",
            "tests/test_map_mutants_nested.py",
        ),
    ),
}

# Compiled tests are left out (-k SKIP: names with "compile", and two that compile without
# saying so in their name): dynamo cannot trace mutmut's trampolines
# (torch.compile(fullgraph=True) of a mutated _prims function fails even unmutated), so the
# code that runs only under compile (_prims/_opaque.py, ops' _compiled) has no tests here.
# Error-message statements are not mutated: their text is checked by the error tests,
# and a mutated message is not a numerical bug (it only multiplies the mutants).
SKIP = "not compile and not fullgraph and not test_call_picks_the_rule_set"
# Tests that fail with no mutant active in this environment (mutmut needs a passing
# selection), per slice: exact equality of `x @ w` (one einsum on packed values) with
# `x.values @ w` (another kernel) fails by one rounding under torch 2.13.0+cpu here.
SKIP_FAILING = {"ops": " and not test_weight_products_run_on_packed_values"}
# Tests too slow to run for every surviving mutant that reaches them (20-60 s each here):
# gradcheck of map's tiles, blocks and groups; the same file compares values and gradients of
# both paths with the loop, which reaches the same code in about a second.
SKIP_SLOW = {
    "map": " and not test_gradcheck_through_groups and not test_row_tiles_gradcheck"
    # 150 generated programs cold and warm (about 40 s); the same file forces each
    # shortcut of the warm call on its own in about a second
    " and not test_generated_programs_give_the_same_answer_warm_and_cold"
    " and not test_row_blocks_gradcheck"
}
# map's reasons for not batching an op (``raise Unsupported(...)``: the text map_report
# shows) are messages too.
DO_NOT_MUTATE = [r"raise fail\(", r"raise RaggedError\(", r"raise Unsupported\("]

# A mutant is stopped (a timeout, counted as killed) after (t + 1 s) * 2 * this CPU seconds,
# t the estimated time of its tests (mutmut's default 15: a mutant that loops would hold the
# shared machine for minutes).
TIMEOUT_MULTIPLIER = 4

# mutmut's own generation step (copy, parse, write the trampolined files), without its
# stats collection and test runs; pinned mutmut (constraints.txt), so its internals hold.
GENERATE = """
import sys
import mutmut.__main__ as m
from pathlib import Path
m.set_mutant_under_test("mutant_generation")
Path("mutants").mkdir(exist_ok=True)
m.copy_src_dir()
m.copy_also_copy_files()
m.setup_source_paths()
stats = m.create_mutants(int(sys.argv[1]))
print(f"{stats.mutated} files mutated, {stats.unmodified} unchanged")
"""

NOT_KILLED = ("survived", "no tests", "not checked", "suspicious", "segfault")


def _config(name: str, part: Slice) -> str:
    def array(items: list[str] | tuple[str, ...]) -> str:
        return "[" + ", ".join(f'"{item}"' for item in items) + "]"

    skip = SKIP + SKIP_FAILING.get(name, "") + SKIP_SLOW.get(name, "")
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["raggedfn/"]\n'
        f"only_mutate = {array(part.packages)}\n"
        f"pytest_add_cli_args_test_selection = {array([*part.tests, '-k', skip])}\n"
        f"do_not_mutate_patterns = {array([p.replace(chr(92), chr(92) * 2) for p in DO_NOT_MUTATE])}\n"
        'pytest_add_cli_args = ["-p", "tests.mutmut_plugin"]\n'
        'also_copy = ["property_tests/", "benchmarks/", "docs/", "README.md"]\n'
        f"timeout_multiplier = {TIMEOUT_MULTIPLIER}\n"
        # each mutant's process forks from a server that has only collected the tests:
        # with mutmut's default ("fork") it forks from the process that ran the stats and
        # the clean tests, inheriting every cache they filled (map's traces, lazily built
        # tables), so code behind a warm cache never runs under the mutant and survives
        'process_isolation = "forkserver"\n'
    )


def _prepare(name: str, part: Slice) -> Path:
    """A copy of the tracked files (refreshed, keeping mutmut's cache) with the config."""
    where = BUILD / name
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        relative = raw.decode()
        source, target = ROOT / relative, where / relative
        if not source.is_file():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_bytes() != source.read_bytes():
            shutil.copy2(source, target)
    pyproject = where / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    pyproject.write_text(text + _config(name, part))
    return where


def _statuses(where: Path, prefixes: tuple[str, ...]) -> dict[str, str]:
    """Every mutant of the slice and its verdict (``not checked`` before it ran)."""
    listing = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=where,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pattern = re.compile(r"^\s*(\S+__mutmut_\d+): (.+)$")
    found = (pattern.match(line) for line in listing.splitlines())
    return {
        hit.group(1): hit.group(2).strip()
        for hit in found
        if hit and hit.group(1).startswith(prefixes)
    }


def draw(names: list[str], sample: str, seed: int, slice_name: str) -> list[str]:
    """``sample`` mutants (or ``all``) drawn uniformly from ``names`` with a fixed seed.

    In the order drawn: a smaller sample of the same seed is a prefix of a larger one
    (``random.sample`` draws one index at a time), so its verdicts are reused.
    """
    ordered = sorted(names)
    if sample == "all" or int(sample) >= len(ordered):
        return ordered
    return random.Random(f"{seed}-{slice_name}").sample(ordered, int(sample))


def wilson(killed: int, tested: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion ``killed / tested``."""
    if tested == 0:
        return (0.0, 1.0)
    p = killed / tested
    centre = (p + z * z / (2 * tested)) / (1 + z * z / tested)
    half = z * math.sqrt(p * (1 - p) / tested + z * z / (4 * tested**2)) / (1 + z * z / tested)
    return (centre - half, centre + half)


def run_slice(name: str, sample: str, seed: int, jobs: int) -> str:
    part = SLICES[name]
    where = _prepare(name, part)
    start = time.perf_counter()
    log = (BUILD / f"{name}.log").open("w")
    # one torch thread per mutant process: frugal on a shared machine, and the CPU-time
    # limit of a mutant (its timeout) then means the same at any thread count
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **os.environ}
    python = [sys.executable, "-c"]
    subprocess.run([*python, GENERATE, str(max(jobs, 1))], cwd=where, stdout=log, check=True)
    statuses = _statuses(where, part.prefixes)
    chosen = draw(list(statuses), sample, seed, name)
    retested: set[str] = set()
    # twice at most: mutmut resets every verdict when the test selection changed, so
    # mutants that were killed before the first pass may have none after it
    for _ in range(2):
        pending = [m for m in chosen if statuses[m] in NOT_KILLED and m not in retested]
        if not pending:
            break
        command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs), *pending]
        done = subprocess.run(command, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:  # a failing clean run or stats collection: no verdicts
            raise SystemExit(f"mutmut failed on slice {name}: see {BUILD / name}.log")
        retested.update(pending)
        statuses = _statuses(where, part.prefixes)
    elapsed = time.perf_counter() - start
    statuses = _statuses(where, part.prefixes)
    counts = Counter(statuses[m] for m in chosen)
    diffs = []
    for mutant in chosen:
        if statuses[mutant] in ("killed", "timeout"):
            continue
        shown = subprocess.run(
            [sys.executable, "-m", "mutmut", "show", mutant],
            cwd=where,
            capture_output=True,
            text=True,
        ).stdout
        diffs.append(f"## {mutant}: {statuses[mutant]}\n{shown}")
    (BUILD / f"{name}.txt").write_text("\n".join(diffs))
    tested = len(chosen) - counts["not checked"]
    killed = counts["killed"] + counts["timeout"]
    low, high = wilson(killed, tested)
    score = 100 * killed / tested if tested else float("nan")
    return (
        f"| {name} | {len(statuses)} | {tested} | {counts['killed']} | {counts['timeout']} | "
        f"{counts['survived']} | {counts['no tests']} | {score:.1f}% | "
        f"{100 * low:.1f}-{100 * high:.1f}% | {elapsed / 60:.1f} min |"
    )


def main(argv: list[str]) -> int:
    slices = argv or os.environ.get("MUTATE_SLICES", "prims ops construct map").split()
    sample = os.environ.get("MUTATE_SAMPLE", "60")
    seed = int(os.environ.get("MUTATE_SEED", "20"))
    jobs = int(os.environ.get("MUTATE_JOBS", "1"))
    parallel = int(os.environ.get("MUTATE_PARALLEL", "2"))
    BUILD.mkdir(parents=True, exist_ok=True)
    if len(slices) > 1 and parallel > 1:
        # each slice in its own process (its own copy and mutmut cache), `parallel` at once
        waiting, running, failed = list(slices), [], []
        while waiting or running:
            while waiting and len(running) < parallel:
                name = waiting.pop(0)
                child = [sys.executable, "-m", "tests.mutate", name]
                running.append((name, subprocess.Popen(child, cwd=ROOT)))
            time.sleep(5)
            for name, process in list(running):
                if process.poll() is not None:
                    running.remove((name, process))
                    if process.returncode != 0:
                        failed.append(name)
        if failed:
            raise SystemExit(f"mutation runs failed for slices {failed}: see {BUILD}/*.log")
    else:
        for name in slices:
            row = run_slice(name, sample, seed, jobs)
            (BUILD / f"{name}.row").write_text(f"{row} {sample} drawn, seed {seed} |\n")
            print(row, flush=True)
    rows = [
        "| slice | mutants | tested | killed | timeout | survived | no tests | killed % "
        "| 95% interval | time | sample |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows += [
        (BUILD / f"{name}.row").read_text().strip()
        for name in SLICES
        if (BUILD / f"{name}.row").exists()
    ]
    (BUILD / "summary.md").write_text("\n".join(rows) + "\n")  # every slice's latest run
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
