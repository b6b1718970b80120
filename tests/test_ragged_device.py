"""Ragged.to / cuda / cpu / pin_memory / is_pinned: every tensor of the value, same flags."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin_memory

import raggedfn
from property_tests.reference import samples

HAS_CUDA = torch.cuda.is_available()


def value() -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(0)
    return raggedfn.from_list([torch.randn(n, 3, generator=gen) for n in (2, 0, 4)])


class CopyRecorder(TorchDispatchMode):
    """Records the ``non_blocking`` flag of every tensor copy (``aten._to_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: list[bool] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.flags.append(bool(kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x.to("meta", non_blocking=True),
        lambda x: x.to("meta", torch.float64, True),
        lambda x: x.to(device="meta", dtype=torch.float64, non_blocking=True, copy=True),
        lambda x: x.to(torch.empty(0, device="meta"), True),
    ],
    ids=["kwarg", "positional", "all_kwargs", "other_tensor"],
)
def test_to_moves_every_tensor_with_non_blocking(call: Any) -> None:
    x = value()
    with CopyRecorder() as recorder:
        y = call(x)
    assert recorder.flags == [True, True, True]  # values, offsets, sizes
    assert {y.values.device.type, y.offsets.device.type, y.sizes.device.type} == {"meta"}
    assert y.offsets.dtype == y.sizes.dtype == torch.int64
    assert y.layout == x.layout


def test_to_blocking_by_default() -> None:
    with CopyRecorder() as recorder:
        value().to("meta")
    assert recorder.flags == [False, False, False]


def test_dtype_applies_to_values_only() -> None:
    x = value()
    y = x.to(torch.float64)
    assert y.dtype == torch.float64 and y.offsets.dtype == y.sizes.dtype == torch.int64
    assert y.offsets is x.offsets and y.sizes is x.sizes  # nothing to move: no copy
    for a, b in zip(samples(y), samples(x), strict=True):
        assert torch.equal(a, b.double())
    z = x.to(raggedfn.from_list([torch.zeros(1, 3, dtype=torch.float16)]))
    assert z.dtype == torch.float16


@pytest.mark.parametrize(
    "call",
    [lambda x: x.to("cpu", copy=True), lambda x: x.to(torch.float32, False, True)],
    ids=["kwarg", "positional"],
)
def test_copy_applies_to_every_tensor(call: Any) -> None:
    x = value()
    y = call(x)
    for name in ("values", "offsets", "sizes"):
        a, b = getattr(y, name), getattr(x, name)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name


def test_cpu_keeps_a_cpu_value() -> None:
    x = value()
    y = x.cpu()
    assert y.device == torch.device("cpu") and y.values is x.values and y.offsets is x.offsets


def test_not_pinned_on_the_host() -> None:
    assert not value().is_pinned()


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without an accelerator")
def test_pin_memory_without_an_accelerator_raises_like_torch() -> None:
    # torch 2.13 CPU: Tensor.pin_memory raises, and DataLoader(pin_memory=True) warns and
    # never starts its pin-memory thread; the thread's function must still reach Ragged
    x = value()
    with pytest.raises(RuntimeError) as expected:
        torch.ones(1).pin_memory()
    with pytest.raises(RuntimeError, match=str(expected.value)):
        x.pin_memory()
    for batch in (x, {"tokens": x, "label": torch.ones(3)}, [x]):
        with pytest.raises(RuntimeError, match=str(expected.value)):
            dataloader_pin_memory(batch)


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without CUDA")
def test_cuda_without_cuda_raises_like_torch() -> None:
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        value().cuda()


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_pin_memory_and_non_blocking_transfer_on_cuda() -> None:
    x = value()
    pinned = x.pin_memory()
    assert pinned.is_pinned() and not x.is_pinned()
    batch = dataloader_pin_memory({"tokens": x, "label": torch.ones(3)})
    assert batch["tokens"].is_pinned() and batch["label"].is_pinned()
    for y in (pinned.to("cuda", non_blocking=True), pinned.cuda(non_blocking=True)):
        assert {t.device.type for t in (y.values, y.offsets, y.sizes)} == {"cuda"}
        torch.cuda.synchronize()
        for a, b in zip(samples(y.cpu()), samples(x), strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_dataloader_pin_memory_thread_pins_ragged_batches() -> None:
    data = [{"tokens": torch.ones(n, 3), "label": n} for n in (1, 2, 3, 4)]
    loader = torch.utils.data.DataLoader(
        data, batch_size=2, collate_fn=raggedfn.data.collate, pin_memory=True
    )
    for batch in loader:
        assert isinstance(batch["tokens"], raggedfn.Ragged) and batch["tokens"].is_pinned()
