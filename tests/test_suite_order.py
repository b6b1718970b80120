"""The suite's collection order (conftest.py at the root) names files that exist."""

from __future__ import annotations

from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parent.parent


def test_every_slow_first_file_exists() -> None:
    missing = [path for path in conftest.SLOW_FIRST if not (ROOT / path).is_file()]
    assert missing == [], "renamed or removed: update SLOW_FIRST in conftest.py"


def test_slow_files_sort_before_the_rest_in_their_listed_order() -> None:
    ids = [
        "tests/test_a.py::t",
        f"{conftest.SLOW_FIRST[1]}::t",
        "property_tests/test_b.py::t",
        f"{conftest.SLOW_FIRST[0]}::t",
    ]
    ordered = sorted(ids, key=conftest.slow_first_key)
    assert ordered == [ids[3], ids[1], ids[0], ids[2]]
