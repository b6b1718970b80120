"""Fixtures shared by several test modules (pytest finds them here without an import)."""

from __future__ import annotations

from typing import Any

import pytest

from raggedfn._map.caching import _warm


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
