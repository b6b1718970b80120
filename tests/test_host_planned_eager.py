"""The code that ``attention`` runs under ``torch.compile``, called eagerly.

Under compile, ``raggedfn.attention`` calls ``ops._attention._compiled``: plain
attention goes to the varlen op, anything else to ``_prims.host_planned``, a custom
op whose implementation (registered with ``_prims.implement``) rebuilds the values
from flat tensors and a meta string and runs the eager op, and whose backward is a
second custom op (``torch.func.vjp`` of that implementation). Custom ops run eagerly
too, so these tests call ``_compiled`` without dynamo and compare it with torch's
SDPA on every sample alone, in values and gradients, with every optional argument.
They reach what the compiled tests reach (``test_fast_paths.py``,
``test_compile_planned.py``) in code that mutation testing can instrument (dynamo
does not trace mutmut's trampolines), and run in a fraction of their time. The last
test reaches ``einsum``'s host-planned node (``ops._products._compiled``) the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from property_tests.reference import samples
from property_tests.test_attention_props import sdpa_sample
from raggedfn import Ragged, RaggedError, _prims
from raggedfn.ops import _attention
from tests.test_fast_paths import DISTINCT, EQUAL, check_attention, options, packed, spy

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def compiled_eagerly(q: Ragged, k: Ragged, v: Ragged, **kwargs: Any) -> Ragged:
    bias, key_padding = kwargs.get("bias"), kwargs.get("key_padding")
    return _attention._compiled(q, k, v, bias, key_padding, kwargs["causal"], kwargs["scale"])


CASES = [  # (bias kind, key padding): every kind of argument the meta string encodes
    ("none", True),
    ("pair", False),
    ("pair_grad", True),
    ("heads", False),
    ("per_sample", False),
]


@pytest.mark.parametrize("scale", [None, 0.6])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("bias", "padding"), CASES)
def test_host_planned_attention_equals_per_sample_sdpa(bias, padding, causal, scale):
    with spy(_attention, "_attention") as planned:
        check_attention(compiled_eagerly, *DISTINCT, bias, padding, causal, scale)
    assert planned  # the registered implementation ran the eager op


@pytest.mark.parametrize("scale", [None, 0.6])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [DISTINCT, EQUAL], ids=["distinct", "equal"])
def test_plain_attention_takes_the_varlen_op(lengths, causal, scale):
    """q, k and v with one head size, no bias or padding: the varlen op, not the plan."""
    n_lengths, m_lengths = lengths
    q, k, v = packed(n_lengths, 0), packed(m_lengths, 1), packed(m_lengths, 2)
    leaves = [t.values.requires_grad_(True) for t in (q, k, v)]
    with spy(_prims, "varlen_attention") as varlen, spy(_attention, "_attention") as planned:
        out = compiled_eagerly(q, k, v, causal=causal, scale=scale)
    assert varlen and not planned
    want = [
        sdpa_sample(a, b, c, None, None, causal, scale)
        for a, b, c in zip(samples(q), samples(k), samples(v), strict=True)
    ]
    torch.testing.assert_close(out.values, torch.cat(want))
    cotangent = torch.randn(
        out.values.shape, generator=torch.Generator().manual_seed(3), dtype=out.values.dtype
    )
    mine = torch.autograd.grad(out.values, leaves, cotangent)
    theirs = torch.autograd.grad(torch.cat(want), leaves, cotangent)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b)


def test_forward_mode_ad_at_the_host_planned_node_is_refused_with_its_reason(monkeypatch):
    """Under compile the node is a custom op without a forward-mode rule (torch.func
    would give zero tangents through it): forward-mode AD there raises, saying why.
    Eagerly (``is_compiling()`` False) the same call runs the eager op."""
    q, k = packed(DISTINCT[0], 0), packed(DISTINCT[1], 1)
    v = packed(DISTINCT[1], 2)
    padding = options(*DISTINCT, "none", True)["key_padding"]

    def run(values: torch.Tensor) -> torch.Tensor:
        return _attention._compiled(q.with_values(values), k, v, None, padding, False, None).values

    tangent = torch.ones_like(q.values)
    torch.func.jvp(run, (q.values,), (tangent,))  # eagerly: no refusal
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(
        RaggedError,
        match=r"forward-mode AD .* inside torch.compile is not supported: ops that plan on "
        r"the host run as one opaque custom op there",
    ):
        torch.func.jvp(run, (q.values,), (tangent,))


EINSUMS = [  # equations that need buckets: a new partition, none, a batched dense operand
    "bnd,bmd->bnm",
    "bnd,bmd->bmn",
    "bnd,bmd->b",
    "bnd,bmd,be->bne",
]


@pytest.mark.parametrize("equation", EINSUMS)
def test_host_planned_einsum_equals_per_sample_einsum(equation, monkeypatch):
    """Under compile ``einsum`` calls ``ops._products._compiled``: the operands' layout
    codes and the parsed spec go into a meta string, and the registered implementation
    decodes it and runs the eager buckets. Reached eagerly with ``is_compiling()``
    patched (the custom op runs eagerly); values and gradients equal torch.einsum of
    every sample alone."""
    import raggedfn
    from raggedfn.ops import _products

    gen = torch.Generator().manual_seed(7)
    ns, ms = [3, 0, 2, 4], [2, 3, 2, 1]
    x = raggedfn.from_list([torch.randn(n, 3, generator=gen, dtype=torch.float64) for n in ns])
    y = raggedfn.from_list([torch.randn(m, 3, generator=gen, dtype=torch.float64) for m in ms])
    e = torch.randn(len(ns), 2, generator=gen, dtype=torch.float64, requires_grad=True)
    leaves = [x.values.requires_grad_(True), y.values.requires_grad_(True), e]
    operands = (x, y, e) if equation.count(",") == 2 else (x, y)
    leaves = leaves[: len(operands)]
    per_sample = equation.replace("b", "")
    want = []
    for b, (a, c) in enumerate(zip(x.values.split(ns), y.values.split(ms), strict=True)):
        want.append(torch.einsum(per_sample, a, c, *((e[b],) if len(operands) == 3 else ())))
    with spy(_products, "_compiled") as compiled, spy(_products, "_bucketed") as bucketed:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        out = _products.einsum(equation, *operands)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert compiled and bucketed  # the spec went through the meta string
    if isinstance(out, Ragged):
        assert out.layout.rank == len(equation.split("->")[1]) - 1
        order = out.layout.logical_to_physical()
        ragged = [a.ragged for a in out.layout.axes]
        assert out.sizes.tolist() == [
            [n for n, r in zip(w.shape, ragged, strict=True) if r] for w in want
        ]
        got = out.values.reshape(-1)
        flat = torch.cat([w.permute(order).reshape(-1) for w in want])
    else:
        got, flat = out, torch.stack(want)
    torch.testing.assert_close(got, flat)
    cotangent = torch.randn(got.shape, generator=gen, dtype=got.dtype)
    mine = torch.autograd.grad(got, leaves, cotangent)
    theirs = torch.autograd.grad(flat, leaves, cotangent)
    for a, c in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, c)
