"""``collate``: a DataLoader batch of variable-size samples as ``Ragged`` values."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._construct import from_list
from .._errors import describe, fail
from .._ragged import Ragged

_FN = "collate"

# what a tensor leaf becomes: None = decided by the batch (a Ragged when the first
# axis varies), "stack" = stacked, "every" = a Ragged along the first axis unless
# 0-d (ragged=True), a tuple of logical axes = a Ragged with those ragged_dims
_Rule = str | tuple[int, ...] | None


def collate(
    batch: Sequence[Any],
    *,
    ragged: bool | Collection[str | int] | Mapping[str | int, int | Sequence[int]] | None = None,
) -> Any:
    """Batch a list of samples (a ``collate_fn`` for ``torch.utils.data.DataLoader``).

    Each sample is a tensor, a Python number, or a dict / tuple / list (named
    tuples too) of those, nested freely; every sample has the same structure.
    Leaf by leaf, the batch gets:

    * a ``Ragged`` (logical shape ``(B, N*, ...)``) where the samples' first
      axis differs in size and every other axis agrees;
    * a stacked tensor ``[B, ...]`` where every shape is equal;
    * a tensor ``[B]`` for Python numbers (int64, float64 or bool, as
      ``torch.utils.data.default_collate``) and numpy scalars; numpy arrays
      are treated as tensors; strings stay a list;
    * a ``Ragged`` one nesting level deeper where the samples are ``Ragged``
      values (``raggedfn.from_list`` of them): a document of ``(S, L*, D)``
      sentences per sample gives ``(B, S*, L*, D)``, its ``(S, L*, L*)`` pair
      states give ``(B, S*, L*, L*)``. This holds for every ``ragged=`` (such
      samples cannot be stacked), except that ``ragged_dims`` other than
      ``(1,)`` for them raise.

    With ``ragged=None`` the choice is made from the batch itself, so a batch
    whose samples happen to have equal lengths (always so with ``B = 1``)
    gives a stacked tensor. To get a ``Ragged`` from every batch, declare the
    ragged leaves: ``functools.partial(collate, ragged=...)`` pickles, so it
    works with worker processes.

    Args:
        batch: ``B >= 1`` samples of the same structure.
        ragged: ``None`` to decide per batch; ``True`` to make every tensor leaf
            of rank >= 1 a ``Ragged`` along its first axis; ``False`` to stack
            everything (unequal shapes raise); a collection of top-level keys
            (dict keys or tuple positions) whose tensors become ``Ragged`` along
            their first axis while the others are stacked; or a mapping from
            such keys to ``ragged_dims`` as in :func:`raggedfn.from_list`
            (logical axes of the batched value, e.g. ``(2, 3)`` for images
            ``[C, H*, W*]``).

    Returns:
        The samples' structure with batched leaves.

    Example:
        >>> import torch, raggedfn
        >>> samples = [{"tokens": torch.ones(2, 4), "label": 0}, {"tokens": torch.ones(3, 4), "label": 1}]
        >>> out = raggedfn.data.collate(samples)
        >>> out["tokens"].shape, out["tokens"].lengths.tolist(), out["label"]
        ((2, None, 4), [2, 3], tensor([0, 1]))
        >>> raggedfn.data.collate([torch.ones(3)], ragged=True).lengths.tolist()
        [3]
        >>> docs = [raggedfn.from_lengths(torch.ones(n, 4), [n - 1, 1]) for n in (3, 5)]
        >>> batch = raggedfn.data.collate(docs)          # one level deeper: (B, S*, L*, 4)
        >>> batch.shape, batch.sizes.tolist()
        ((2, None, None, 4), [[2, 3], [2, 5]])
    """
    if isinstance(batch, (Tensor, Ragged, str, bytes)) or not isinstance(batch, Sequence):
        raise fail(_FN, f"batch must be a list of samples, got {describe(batch)}")
    if len(batch) == 0:
        raise fail(_FN, "batch is empty; a batch needs at least one sample to know its structure")
    first = batch[0]
    top = _top_rules(ragged, first)
    if top is None:
        rule: _Rule = "stack" if ragged is False else "every" if ragged is True else None
        return _collate(list(batch), "batch", rule)
    if isinstance(first, Mapping):
        return _collate_mapping(list(batch), "batch", lambda key: top.get(key, "stack"))
    return _collate_sequence(list(batch), "batch", lambda key: top.get(key, "stack"))


def _top_rules(ragged: Any, first: Any) -> dict[Any, _Rule] | None:
    """Per top-level key rules when ``ragged`` names keys, else ``None``."""
    if ragged is None or isinstance(ragged, bool):
        return None
    if isinstance(ragged, (str, bytes, Tensor)) or not isinstance(ragged, Collection):
        raise fail(
            _FN,
            f"ragged must be None, a bool, a collection of keys or a mapping of keys to "
            f"ragged_dims, got {describe(ragged)}",
        )
    if isinstance(first, Mapping):
        keys = set(first)
    elif isinstance(first, (tuple, list)):
        keys = set(range(len(first)))
    else:
        raise fail(
            _FN,
            f"ragged names keys {_keys(ragged)} but a sample is "
            f"{describe(first)}, not a dict, tuple or list; use ragged=True",
        )
    rules: dict[Any, _Rule] = {}
    for key in ragged:
        if key not in keys:
            raise fail(
                _FN,
                f"ragged names key {key!r}, which a sample does not have (its keys: {_keys(keys)})",
            )
        dims = ragged[key] if isinstance(ragged, Mapping) else 1
        rules[key] = (dims,) if isinstance(dims, int) else tuple(dims)
    return rules


def _keys(keys: Any) -> str:
    return "[" + ", ".join(sorted(map(repr, keys))) + "]"


def _collate(samples: list[Any], path: str, rule: _Rule) -> Any:
    first = samples[0]
    if isinstance(first, Ragged):
        return _collate_ragged(samples, path, rule)
    if isinstance(first, np.ndarray) and first.dtype.kind in "biufc":
        samples = [torch.as_tensor(s) if isinstance(s, np.ndarray) else s for s in samples]
        first = samples[0]
    if isinstance(first, Tensor):
        return _collate_tensors(samples, path, rule)
    if isinstance(first, (bool, int, float, complex, np.number, np.bool_)):
        return _collate_numbers(samples, path)
    if isinstance(first, (str, bytes)):
        _same_type(samples, path, (str, bytes))
        return list(samples)
    if isinstance(first, Mapping):
        return _collate_mapping(samples, path, lambda key: rule)
    if isinstance(first, (tuple, list)):
        return _collate_sequence(samples, path, lambda key: rule)
    raise fail(
        _FN,
        f"{path} of sample 0 is {describe(first)}; samples may hold tensors, numpy arrays, "
        "numbers and strings in dicts, tuples and lists",
    )


def _same_type(samples: list[Any], path: str, kind: Any) -> None:
    for i, s in enumerate(samples):
        if not isinstance(s, kind):
            raise fail(
                _FN,
                f"{path} of sample {i} is {describe(s)}, but sample 0 has {describe(samples[0])}",
            )


def _collate_mapping(samples: list[Any], path: str, rule_of: Any) -> Any:
    first = samples[0]
    _same_type(samples, path, Mapping)
    for i, s in enumerate(samples):
        if s.keys() != first.keys():
            raise fail(
                _FN,
                f"{path} of sample {i} has keys {_keys(s)}, but sample 0 has {_keys(first)}",
            )
    out = {
        key: _collate([s[key] for s in samples], f"{path}[{key!r}]", rule_of(key)) for key in first
    }
    try:
        return type(first)(out)
    except TypeError:  # a mapping type without a dict constructor
        return out


def _collate_sequence(samples: list[Any], path: str, rule_of: Any) -> Any:
    first = samples[0]
    _same_type(samples, path, type(first))
    for i, s in enumerate(samples):
        if len(s) != len(first):
            raise fail(
                _FN,
                f"{path} of sample {i} has {len(s)} entries, but sample 0 has {len(first)}",
            )
    out = [_collate([s[k] for s in samples], f"{path}[{k}]", rule_of(k)) for k in range(len(first))]
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # named tuple
        return type(first)(*out)
    try:
        return type(first)(out)
    except TypeError:
        return out


def _collate_numbers(samples: list[Any], path: str) -> Tensor:
    _same_type(samples, path, (bool, int, float, complex, np.number, np.bool_))
    if all(isinstance(s, (bool, np.bool_)) for s in samples):
        return torch.tensor([bool(s) for s in samples])
    if all(isinstance(s, np.number) for s in samples):
        return torch.as_tensor(np.stack(samples))
    if any(isinstance(s, (bool, np.bool_)) for s in samples):
        raise fail(_FN, f"{path} mixes bools with other numbers across samples")
    if all(isinstance(s, int) for s in samples):
        return torch.tensor(samples, dtype=torch.int64)
    if any(isinstance(s, complex) for s in samples):
        return torch.tensor([complex(s) for s in samples], dtype=torch.complex128)
    return torch.tensor([float(s) for s in samples], dtype=torch.float64)


def _collate_tensors(samples: list[Any], path: str, rule: _Rule) -> Any:
    _same_type(samples, path, Tensor)
    first: Tensor = samples[0]
    for i, t in enumerate(samples):
        if t.dtype != first.dtype or t.device != first.device or t.ndim != first.ndim:
            raise fail(
                _FN,
                f"{path} of sample {i} is {describe(t)}, but sample 0 is {describe(first)}; "
                "samples must agree on dtype, device and rank",
            )
    if rule is None:
        if all(t.shape == first.shape for t in samples):
            return _stack(samples)
        rule = (1,)
    elif rule == "every":
        if first.ndim == 0:
            return _stack(samples)
        rule = (1,)
    elif rule == "stack":
        mismatch = next((i for i, t in enumerate(samples) if t.shape != first.shape), None)
        if mismatch is not None:
            raise fail(
                _FN,
                f"{path} of sample {mismatch} has shape {tuple(samples[mismatch].shape)}, but "
                f"sample 0 has {tuple(first.shape)}; tensors of unequal shapes need "
                "ragged= to name them (or ragged=None)",
            )
        return _stack(samples)
    if first.ndim == 0:
        raise fail(_FN, f"{path} is a 0-d tensor, which has no axis to be ragged")
    assert isinstance(rule, tuple)
    try:
        return from_list(samples, ragged_dims=rule)
    except ValueError as error:
        raise fail(_FN, f"{path}: {error}") from error


def _collate_ragged(samples: list[Any], path: str, rule: _Rule) -> Ragged:
    """``Ragged`` samples: one value with one nesting level more (their batch axis
    becomes a ragged axis nested in the new batch axis); they cannot be stacked."""
    _same_type(samples, path, Ragged)
    if isinstance(rule, tuple) and rule != (1,):
        raise fail(
            _FN,
            f"{path} holds Ragged samples, which keep their own ragged axes; ragged= gives "
            f"them ragged_dims {rule}, which only tensor leaves take",
        )
    try:
        return from_list(samples)
    except ValueError as error:
        raise fail(_FN, f"{path}: {error}") from error


def _stack(samples: list[Tensor]) -> Tensor:
    # default_collate stacks straight into shared memory inside a worker process
    return torch.utils.data.default_collate(samples)
