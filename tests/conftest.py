"""Fixtures shared by several test modules (pytest finds them here without an import)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from raggedfn._map.caching import _warm

# `make test` runs one pytest-xdist worker per core: each takes its share of the cores for
# torch's intra-op threads instead of all of them (no oversubscribed cores)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def took(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per ``raggedfn.map`` call: whether the warm path (``_warm.call``) answered it."""
    seen: list[bool] = []
    real = _warm.call

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        seen.append(out is not _warm.MISS)
        return out

    monkeypatch.setattr(_warm, "call", spy)
    return seen
