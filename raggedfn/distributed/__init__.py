"""Collectives on ``Ragged`` values over ``torch.distributed`` process groups."""

from ._collectives import all_gather, all_to_all

__all__ = ["all_gather", "all_to_all"]
