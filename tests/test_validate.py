"""``raggedfn._validate.is_tracing``: which tensors carry no data to read."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from raggedfn._validate import is_tracing


def test_plain_tensors_are_not_traced():
    assert not is_tracing(torch.arange(3))
    assert not torch.func.grad(lambda t: t.sum() * 0 + is_tracing(t))(torch.ones(2)).any()


def test_fake_tensors_are_traced_bare_and_wrapped():
    with FakeTensorMode() as mode:
        fake = torch.arange(3)
    assert is_tracing(fake)
    # functionalization (C++ wrapper, type Tensor) around a fake tensor
    wrapped = torch._to_functional_tensor(fake)
    assert type(wrapped) is torch.Tensor and is_tracing(wrapped)
    # a functorch transform's wrapper (type Tensor) around a fake tensor
    seen = []
    with mode:
        torch.func.vmap(lambda t: seen.append(is_tracing(t)) or t)(torch.ones(2, 3))
    assert seen == [True]
