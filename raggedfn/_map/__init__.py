"""raggedfn.map: run a per-sample function over a packed batch."""

from ._api import map, map_cache_info, map_report
from ._cache import CacheInfo
from ._report import MapReport

__all__ = ["CacheInfo", "MapReport", "map", "map_cache_info", "map_report"]
