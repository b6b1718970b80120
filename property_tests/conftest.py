"""The seed of the generated programs (``map_runs.program_seed``), said at the end of
every run that collected this folder, so that any failure can be rerun."""

from __future__ import annotations

from typing import Any

from property_tests.map_runs import SEED_ENV, program_seed


def pytest_terminal_summary(terminalreporter: Any) -> None:
    seed, source = program_seed()
    terminalreporter.write_line(
        f"generated map programs: seed {seed} ({source}); rerun with {SEED_ENV}={seed}"
    )
