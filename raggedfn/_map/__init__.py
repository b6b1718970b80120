"""raggedfn.map: run a per-sample function over a packed batch."""

from ._api import map, map_report
from ._report import MapReport

__all__ = ["MapReport", "map", "map_report"]
