"""Mutation testing with mutmut, one slice per package, each with its own fast tests.

``make mutate`` runs ``python -m tests.mutate``. Each slice runs in its own copy
of the tracked files under ``build/mutate/<slice>/`` with a ``[tool.mutmut]``
section naming the package to mutate and the slice's fast test selection (mutmut
then runs, per mutant, only the tests of that selection that reach the mutated
function, fastest first, stopping at the first failure; each mutant runs in a
process forked from one warm interpreter, so torch is imported once). Results
stay cached in the slice's ``mutants/``: a second run re-tests only changed code.

Options (environment, as ``make mutate MUTATE_SLICES=...``):
    MUTATE_SLICES: slices to run, in order (default ``prims ops construct map``:
        ``map`` last, its code is being rewritten).
    MUTATE_SAMPLE: a character class of last digits of the mutant number,
        ``[0-9]`` for every mutant; the default ``[05]`` runs every fifth, which
        keeps the whole target under an hour on the shared 2-core machine.
    MUTATE_JOBS: mutants tested at once (default 1; run under ``nice -n 19``).

Prints, per slice, killed / survived / no tests / timeouts and the time taken,
writes ``build/mutate/<slice>.txt`` with every surviving mutant, and
``build/mutate/summary.md``. Not part of ``make test``.
"""

from __future__ import annotations

import os
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
    package: str  # mutmut's only_mutate glob
    prefix: str  # mutant names start with this
    tests: tuple[str, ...]


SLICES = {
    "prims": Slice(
        "raggedfn/_prims/*",
        "raggedfn._prims.",
        (
            "tests/test_prims.py",
            "tests/test_sdpa_prim.py",
            "tests/test_varlen_prim.py",
            "tests/test_scan.py",
            "tests/test_fast_paths.py",
        ),
    ),
    "ops": Slice(
        "raggedfn/ops/*",
        "raggedfn.ops.",
        (
            "tests/test_reduce.py",
            "tests/test_scan.py",
            "tests/test_shape.py",
            "tests/test_select.py",
            "tests/test_elementwise.py",
            "tests/test_nn.py",
            "tests/test_products.py",
            "tests/test_fast_paths.py",
        ),
    ),
    "construct": Slice(
        "raggedfn/_construct.py",
        "raggedfn._construct.",
        ("tests/test_construct.py", "tests/test_ragged.py"),
    ),
    "map": Slice("raggedfn/_map/*", "raggedfn._map.", ("tests/test_map.py",)),
}

# Compiled tests are left out (-k "not compile"): dynamo cannot trace mutmut's trampolines
# (torch.compile(fullgraph=True) of a mutated _prims function fails even unmutated), so the
# code that runs only under compile (_prims/_opaque.py, ops' _compiled) has no tests here.
# Error-message statements are not mutated: their text is checked by the error tests,
# and a mutated message is not a numerical bug (it only multiplies the mutants).
DO_NOT_MUTATE = [r"raise fail\(", r"raise RaggedError\("]


def _config(part: Slice) -> str:
    def array(items: list[str] | tuple[str, ...]) -> str:
        return "[" + ", ".join(f'"{item}"' for item in items) + "]"

    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["raggedfn/"]\n'
        f"only_mutate = {array([part.package])}\n"
        f"pytest_add_cli_args_test_selection = {array([*part.tests, '-k', 'not compile'])}\n"
        f"do_not_mutate_patterns = {array([p.replace(chr(92), chr(92) * 2) for p in DO_NOT_MUTATE])}\n"
        'also_copy = ["property_tests/", "benchmarks/", "docs/", "README.md"]\n'
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
    pyproject.write_text(text + _config(part))
    return where


def _counts(where: Path, prefix: str, sample: str) -> tuple[Counter[str], list[str]]:
    listing = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=where,
        capture_output=True,
        text=True,
    ).stdout
    pattern = re.compile(r"^\s*(\S+__mutmut_(\d+)): (.+)$")
    counts: Counter[str] = Counter()
    survivors = []
    for line in listing.splitlines():
        found = pattern.match(line)
        if not found or not found.group(1).startswith(prefix):
            continue
        if not re.fullmatch(sample, found.group(2)[-1]):
            continue
        status = found.group(3).strip()
        counts[status] += 1
        if status in ("survived", "no tests"):
            survivors.append(f"{found.group(1)}: {status}")
    return counts, survivors


def run_slice(name: str, sample: str, jobs: int) -> str:
    part = SLICES[name]
    where = _prepare(name, part)
    start = time.perf_counter()
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)]
    command.append(f"{part.prefix}*__mutmut_*{sample}")
    log = (BUILD / f"{name}.log").open("w")
    subprocess.run(command, cwd=where, stdout=log, stderr=subprocess.STDOUT, check=False)
    elapsed = time.perf_counter() - start
    counts, survivors = _counts(where, part.prefix, sample)
    (BUILD / f"{name}.txt").write_text("\n".join(survivors) + "\n")
    tested = sum(counts.values())
    killed = counts["killed"] + counts["timeout"]
    score = 100 * killed / tested if tested else float("nan")
    return (
        f"| {name} | {tested} | {counts['killed']} | {counts['timeout']} | "
        f"{counts['survived']} | {counts['no tests']} | {score:.1f}% | {elapsed / 60:.1f} min |"
    )


def main(argv: list[str]) -> int:
    slices = argv or os.environ.get("MUTATE_SLICES", "prims ops construct map").split()
    sample = os.environ.get("MUTATE_SAMPLE", "[05]")
    jobs = int(os.environ.get("MUTATE_JOBS", "1"))
    BUILD.mkdir(parents=True, exist_ok=True)
    rows = [
        f"mutants whose number ends in {sample}",
        "",
        "| slice | mutants | killed | timeout | survived | no tests | killed % | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in slices:
        rows.append(run_slice(name, sample, jobs))
        print(rows[-1], flush=True)
    (BUILD / "summary.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
