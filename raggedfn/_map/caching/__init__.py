"""Plans per signature: the cache, plan groups, lookup and the warm path."""

from ._cache import CacheInfo

__all__ = ["CacheInfo"]
