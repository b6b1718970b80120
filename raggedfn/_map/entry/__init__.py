"""The public entry points: map, map_report, map_cache_info and _clear, map inside torch.compile."""

from ._api import map, map_cache_clear, map_cache_info, map_report

__all__ = ["map", "map_cache_clear", "map_cache_info", "map_report"]
