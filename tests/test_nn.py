"""linear, layer_norm, rms_norm: errors, storage orders and immutability."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from raggedfn import RaggedError


def tokens(dtype=torch.float64):
    return raggedfn.from_list([torch.randn(2, 4, dtype=dtype), torch.randn(3, 4, dtype=dtype)])


def test_linear_errors() -> None:
    x = tokens()
    w = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(
        RaggedError,
        match=r"linear: axis 2 is ragged but must be dense \(logical shape \(4, N\*\)\)",
    ):
        raggedfn.linear(raggedfn.transpose(x, 1, 2), torch.randn(5, 2, dtype=torch.float64))
    with pytest.raises(
        RaggedError,
        match=r"linear: weight must have shape \(5, 4\), got a torch.float64 tensor of shape \(5, 3\)",
    ):
        raggedfn.linear(x, torch.randn(5, 3, dtype=torch.float64))
    with pytest.raises(
        RaggedError,
        match=r"linear: weight must have the dtype of x \(torch.float64\), got a torch.float32",
    ):
        raggedfn.linear(x, w.float())
    with pytest.raises(
        RaggedError,
        match=r"linear: weight must be on the device of x \(cpu\), got a torch.float64 tensor of shape \(5, 4\) on meta",
    ):
        raggedfn.linear(x, w.to("meta"))
    with pytest.raises(RaggedError, match=r"linear: bias must have shape \(5,\)"):
        raggedfn.linear(x, w, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RaggedError, match=r"linear: weight must be a \[D_out, D_in\] tensor"):
        raggedfn.linear(x, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RaggedError, match=r"linear: x must be a Ragged value"):
        raggedfn.linear(torch.zeros(2, 4), w)


def test_norm_errors() -> None:
    x = tokens()
    with pytest.raises(
        RaggedError, match=r"layer_norm: normalized_shape \(3,\) must equal the trailing axes"
    ):
        raggedfn.layer_norm(x, 3)
    with pytest.raises(RaggedError, match=r"layer_norm: axis 1 is ragged but must be dense"):
        raggedfn.layer_norm(x, (2, 4))
    with pytest.raises(
        RaggedError, match=r"rms_norm: needs the last 3 axes to be dense but a sample has rank 2"
    ):
        raggedfn.rms_norm(x, (1, 2, 4))
    with pytest.raises(RaggedError, match=r"rms_norm: weight must have the dtype of x"):
        raggedfn.rms_norm(x, 4, torch.ones(4))
    with pytest.raises(RaggedError, match=r"layer_norm: normalized_shape must hold ints"):
        raggedfn.layer_norm(x, (None,))


def test_dense_axes_stored_out_of_order() -> None:
    """Logical (N*, 3, 4) stored as [T, 4, 3]: the norm runs over the logical last axes."""
    base = raggedfn.from_list([torch.randn(2, 4, 3, dtype=torch.float64)])
    x = raggedfn.transpose(base, 2, 3)
    y = raggedfn.layer_norm(x, (3, 4))
    torch.testing.assert_close(y[0], F.layer_norm(x[0], (3, 4)))
    z = raggedfn.linear(x, torch.eye(4, dtype=torch.float64)[:2])
    torch.testing.assert_close(z[0], x[0][..., :2])


def test_no_input_is_modified() -> None:
    x = tokens()
    w = torch.randn(5, 4, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64)
    scale = torch.ones(4, dtype=torch.float64)
    before = (x.values._version, w._version, b._version, scale._version)
    raggedfn.linear(x, w, b)
    raggedfn.layer_norm(x, 4, scale, scale)
    raggedfn.rms_norm(x, 4, scale)
    assert (x.values._version, w._version, b._version, scale._version) == before
