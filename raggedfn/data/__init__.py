"""Loading ragged data with ``torch.utils.data``: ``collate`` and token-budget batches."""

from ._collate import collate
from ._sampler import TokenBudgetBatchSampler

__all__ = ["TokenBudgetBatchSampler", "collate"]
