"""Plant each of five one-line bugs the suite must catch, run its targeted tests, time them, restore.

Run from the repository root: ``python -m tests.planted_bugs [name ...]``. Each bug is
planted by replacing one exact line, the targeted selection runs with ``pytest -x``,
and the file is restored whatever happens. Prints one row per bug: whether the
selection failed (caught) and how long it took. Not part of the test suite.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple


class Bug(NamedTuple):
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


BUGS = {
    "logsumexp_without_shift": Bug(
        "raggedfn/_prims/_softmax.py",
        "    shift = _shift(values, segments, num_segments, dims)\n",
        "    shift = _shift(values, segments, num_segments, dims) * 0\n",
        ("tests/test_prims.py",),
    ),
    "compiled_attention_drops_scale": Bug(
        "raggedfn/ops/_attention.py",
        "q.values, k.values, v.values, q.offsets, k.offsets, v.offsets, causal, scale",
        "q.values, k.values, v.values, q.offsets, k.offsets, v.offsets, causal, None",
        ("tests/test_fast_paths.py", "-k", "compiled"),
    ),
    "cumsum_first_ragged_axis_exclusive": Bug(
        "raggedfn/ops/_scan.py",
        "    moved = segment_cumsum(take_rows(values, source), moved_starts)",
        "    moved = segment_cumsum(take_rows(values, source), moved_starts)"
        " - take_rows(values, source)",
        ("tests/test_scan.py",),
    ),
    "permute_inverse": Bug(
        "raggedfn/ops/_shape.py",
        "    axes = tuple(x.layout.axes[d - 1] for d in normal[1:])",
        "    axes = tuple(x.layout.axes[normal.index(p) - 1] for p in range(1, x.ndim))",
        ("tests/test_shape.py",),
    ),
    "no_monotone_offsets_check": Bug(
        "raggedfn/_validate.py",
        "    if bool((steps < 0).any()):",
        "    if False:",
        ("tests/test_construct.py",),
    ),
}


def _pytest(tests: tuple[str, ...]) -> tuple[int, float]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", *tests], capture_output=True, text=True
    )
    return result.returncode, time.perf_counter() - start


def run(name: str, bug: Bug) -> tuple[bool, float]:
    """``(caught, seconds)``; the selection must pass on the unchanged code first."""
    path = Path(bug.path)
    original = path.read_text()
    if original.count(bug.old) != 1:
        raise SystemExit(f"{name}: the line to replace is not in {bug.path} exactly once")
    code, _ = _pytest(bug.tests)
    if code != 0:
        raise SystemExit(f"{name}: {' '.join(bug.tests)} fails without the bug")
    try:
        path.write_text(original.replace(bug.old, bug.new))
        code, elapsed = _pytest(bug.tests)
    finally:
        path.write_text(original)
    return code != 0, elapsed


def main(names: list[str]) -> int:
    missed = 0
    for name in names or list(BUGS):
        caught, elapsed = run(name, BUGS[name])
        missed += not caught
        verdict = "caught" if caught else "MISSED"
        print(f"| {name} | `{' '.join(BUGS[name].tests)}` | {verdict} | {elapsed:.1f} s |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
