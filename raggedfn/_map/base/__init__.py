"""Values, sizes, plan steps and the rule registry that every phase shares."""

from ._report import MapReport

__all__ = ["MapReport"]
