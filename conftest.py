"""Suite-wide collection order: the slowest test files first.

`make test` runs pytest-xdist with ``--dist loadfile``: whole files go to the workers in
collection order, a batch each at the start and one more whenever a worker is free. A
long file collected last (the generated map programs, several minutes) would start
when the other worker has nothing left to do; started first, it runs beside
everything else. Only the order changes: every test still runs.
"""

from __future__ import annotations

import pytest

# the longest files of a fresh-clone run (--durations), longest first
SLOW_FIRST = (
    "property_tests/test_map_programs.py",
    "tests/test_hf_bert_bench.py",
    "tests/test_map_compile_train.py",
    "tests/test_map_compile.py",
    "tests/test_export.py",
    "tests/test_distributed_fsdp.py",
    "tests/test_map_compile_hf.py",
    "tests/test_nested_compile.py",
)


def slow_first_key(nodeid: str) -> int:
    path = nodeid.split("::", 1)[0]
    return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: slow_first_key(item.nodeid))  # stable: file order kept
