"""The plain-op bodies of the segment primitives equal torch per segment.

``_prims._forward.call`` runs a primitive's *body* (its forward as plain torch ops)
instead of its custom Function where dynamo traces inside a ``torch.func`` transform
or with forward mode active; there torch's own rules differentiate the body, so its
values, gradients and forward-mode derivatives must be torch's. ``_extrema._composite``
and ``_softmax._softmax`` run nowhere else, and the compiled tests cannot reach them
under mutation testing (dynamo does not trace mutmut's trampolines), so they are
called directly here, against torch's op on every segment alone: values with ties,
infinities, a signed zero, shifted magnitudes (``exp`` overflows without the segment
maximum) and empty segments.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.func import jacfwd, jacrev

from raggedfn._prims import _extrema, _prod, _sdpa, _softmax

INF = math.inf
# Unsorted segment ids; segments 1 and 4 are empty.
SEGMENTS = torch.tensor([0, 0, 2, 2, 2, 3, 0])
NUM = 5
PRESENT = [0, 2, 3]
ROWS = [(SEGMENTS == s).nonzero().squeeze(1) for s in range(NUM)]


def _values(largest: bool) -> torch.Tensor:
    """``[7, 4]``: distinct values; two-way ties; infinite extrema tied; a lone -0.0 / +0.0."""
    sign = 1.0 if largest else -1.0
    columns = [
        [0.3, -1.2, 0.8, 2.5, -0.4, 1.1, 0.9],
        [2.0, 2.0, 5.0, -1.0, 5.0, 3.0, 1.0],
        [sign * INF, sign * INF, -sign * INF, 3.0, -sign * INF, -0.0, 0.0],
        [1.0, -2.0, 4.0, 4.0, 4.0, 0.0, -2.0],
    ]
    return sign * torch.tensor(columns, dtype=torch.float64).T.contiguous()


def _per_segment(op: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """``op`` on the rows of every present segment, stacked in segment order."""
    return torch.stack([op(values[ROWS[s]]) for s in PRESENT])


@pytest.mark.parametrize("largest", [True, False])
def test_extremum_body_equals_torch_amax_per_segment(largest: bool) -> None:
    values = _values(largest).requires_grad_(True)
    torch_op = torch.amax if largest else torch.amin

    def body(v: torch.Tensor) -> torch.Tensor:
        return _extrema._composite(v, SEGMENTS, NUM, largest)

    def reference(v: torch.Tensor) -> torch.Tensor:
        return _per_segment(lambda rows: torch_op(rows, 0), v)

    out, want = body(values), reference(values)
    assert torch.equal(out[PRESENT], want)
    assert torch.equal(torch.signbit(out[PRESENT]), torch.signbit(want))  # -0.0 stays -0.0
    identity = -INF if largest else INF
    assert out[[1, 4]].eq(identity).all()
    weights = torch.linspace(0.5, 2.0, out[PRESENT].numel(), dtype=torch.float64)
    weights = weights.view_as(want)
    (got,) = torch.autograd.grad((out[PRESENT] * weights).sum(), values)
    (expected,) = torch.autograd.grad((want * weights).sum(), values)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # forward mode through torch's rules: the Jacobian of torch.amax per segment
    torch.testing.assert_close(
        jacfwd(lambda v: body(v)[PRESENT])(values.detach()),
        jacrev(reference)(values.detach()),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("largest", [True, False])
def test_extremum_body_of_integers_is_the_plain_extremum(largest: bool) -> None:
    values = torch.tensor([[3, -1], [7, 2], [0, 0], [-5, 9], [1, 1], [4, -4], [7, 8]])
    out = _extrema._composite(values, SEGMENTS, NUM, largest)
    torch_op = torch.amax if largest else torch.amin
    assert out.dtype == torch.int64
    assert torch.equal(out[PRESENT], _per_segment(lambda rows: torch_op(rows, 0), values))
    info = torch.iinfo(torch.int64)
    assert out[[1, 4]].eq(info.min if largest else info.max).all()


def _softmax_values(dtype: torch.dtype) -> torch.Tensor:
    """``[7, 3]``: ordinary values; +-1e3 (exp overflows/underflows unshifted); a -inf entry."""
    columns = [
        [0.3, -1.2, 0.8, 2.5, -0.4, 1.1, 0.9],
        [1000.0, 999.0, -1000.0, -1001.0, -998.0, 1000.0, 1000.0],
        [0.5, -INF, 2.0, -INF, 1.0, 4.0, 0.0],
    ]
    return torch.tensor(columns, dtype=dtype).T.contiguous()


BODIES = {
    "softmax": (_softmax._softmax, lambda rows: torch.softmax(rows, 0)),
    "log_softmax": (_softmax._log_softmax, lambda rows: torch.log_softmax(rows, 0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(BODIES))
def test_softmax_bodies_equal_torch_per_segment(name: str, dtype: torch.dtype) -> None:
    body_op, torch_op = BODIES[name]
    values = _softmax_values(dtype).requires_grad_(True)

    def body(v: torch.Tensor) -> torch.Tensor:
        out = body_op(v, SEGMENTS, NUM)
        return torch.cat([out[ROWS[s]] for s in PRESENT])

    def reference(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch_op(v[ROWS[s]]) for s in PRESENT])

    out, want = body(values), reference(values)
    assert torch.isfinite(want[:, :2]).all()
    torch.testing.assert_close(out, want)
    weights = torch.linspace(-1.0, 2.0, want.numel(), dtype=dtype).view_as(want)
    finite = torch.isfinite(want)  # log_softmax of a -inf entry is -inf: no gradient there
    (got,) = torch.autograd.grad((torch.where(finite, out, 0) * weights).sum(), values)
    (expected,) = torch.autograd.grad((torch.where(finite, want, 0) * weights).sum(), values)
    torch.testing.assert_close(got, expected)
    if dtype == torch.float64:
        plain = values.detach()[:, :2]
        torch.testing.assert_close(jacfwd(body)(plain), jacrev(reference)(plain))


def test_softmax_body_of_a_segment_of_only_minus_inf_is_nan_as_torch() -> None:
    values = torch.tensor([[0.0], [1.0], [-INF], [-INF], [-INF], [2.0], [3.0]])
    out = _softmax._softmax(values, SEGMENTS, NUM)
    assert torch.isnan(torch.softmax(values[ROWS[2]], 0)).all()
    assert torch.isnan(out[ROWS[2]]).all()
    torch.testing.assert_close(out[ROWS[0]], torch.softmax(values[ROWS[0]], 0))


def test_product_body_equals_torch_prod_per_segment_with_zeros() -> None:
    values = torch.tensor(
        [[2.0, 0.0], [3.0, 0.0], [0.5, 1.5], [-2.0, 0.0], [4.0, 2.0], [7.0, -1.0], [1.5, 3.0]],
        dtype=torch.float64,
    )

    def body(v: torch.Tensor) -> torch.Tensor:
        return _prod._product(v, SEGMENTS, NUM)

    out = body(values)
    torch.testing.assert_close(out[PRESENT], _per_segment(lambda rows: torch.prod(rows, 0), values))
    assert out[[1, 4]].eq(1).all()


@pytest.mark.parametrize("chunk", [1 << 22, 12])  # one block of query rows, or several
def test_attention_body_as_dynamo_traces_it_equals_torch_sdpa(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_sdpa._forward`` as dynamo traces it (``is_compiling()``: out-of-place ``exp``, the
    body torch's transforms differentiate there): torch's SDPA in values and gradients,
    and its logsumexp."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    monkeypatch.setattr(_sdpa, "CHUNK_LOGITS", chunk)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out, lse = _sdpa._forward(q, k, v, None, None, 0.5)
    monkeypatch.undo()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
    torch.testing.assert_close(out, want)
    logits = (q @ k.transpose(-1, -2)) * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1, keepdim=True))
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w)


ENTRIES = {
    "softmax": (_softmax.segment_softmax, lambda rows: torch.softmax(rows, 0)),
    "log_softmax": (_softmax.segment_log_softmax, lambda rows: torch.log_softmax(rows, 0)),
}


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_softmax_primitives_under_a_transform_in_dynamo_code_run_their_body(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside code dynamo traces, under a ``torch.func`` transform (``jacfwd`` here, with
    ``is_compiling()`` patched) each primitive runs its plain-op body: the Jacobian is
    torch's per segment."""
    entry, torch_op = ENTRIES[name]
    plain = _softmax_values(torch.float64)[:, :2].contiguous()

    def reference(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch_op(v[ROWS[s]]) for s in PRESENT])

    want = jacrev(reference)(plain)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def prim(v: torch.Tensor) -> torch.Tensor:
        out = entry(v, SEGMENTS, NUM)
        return torch.cat([out[ROWS[s]] for s in PRESENT])

    torch.testing.assert_close(jacfwd(prim)(plain), want)
