"""raggedfn.map: run a per-sample function over a packed batch.

Sub-packages by phase, each importing only the ones named before it here: ``base`` (values,
sizes, plan steps, the rule registry), ``rules`` (batching rules), ``tracing`` (f into a
plan), ``running`` (a plan on a batch), ``caching`` (plans per signature, the warm path),
``entry`` (the public entry points).
"""

from .base import MapReport
from .caching import CacheInfo
from .entry import map, map_cache_clear, map_cache_info, map_report

__all__ = ["CacheInfo", "MapReport", "map", "map_cache_clear", "map_cache_info", "map_report"]
