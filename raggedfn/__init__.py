"""raggedfn: pure-functional ragged tensors for PyTorch."""

from . import _tree  # noqa: F401  (Ragged as a pytree node; first, before any use)
from . import data as data
from . import distributed as distributed
from ._construct import check, from_lengths, from_list, from_offsets, from_sizes, unbind
from ._construct_interop import cu_seqlens, from_nested, to_nested
from ._construct_nested import from_nested_lengths, from_segment_ids
from ._errors import RaggedError, RaggedPerformanceWarning
from ._interop import positions, segment_ids
from ._layout import Axis, Layout
from ._map import CacheInfo, MapReport, map, map_cache_clear, map_cache_info, map_report
from ._padded import from_padded, mask, to_padded
from ._ragged import Ragged
from .ops import *  # noqa: F403
from .ops import __all__ as _ops_all

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "CacheInfo",
    "Layout",
    "MapReport",
    "Ragged",
    "RaggedError",
    "RaggedPerformanceWarning",
    "check",
    "cu_seqlens",
    "from_lengths",
    "from_list",
    "from_nested",
    "from_nested_lengths",
    "from_offsets",
    "from_padded",
    "from_segment_ids",
    "from_sizes",
    "map",
    "map_cache_clear",
    "map_cache_info",
    "map_report",
    "mask",
    "positions",
    "segment_ids",
    "to_nested",
    "to_padded",
    "unbind",
    *_ops_all,
]
