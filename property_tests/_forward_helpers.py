"""Forward-mode comparison against per-sample loops: ``jvp`` of an op vs the loop's ``jvp``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from property_tests._pairs_helpers import tight_buckets
from property_tests.reference import assert_same, samples
from raggedfn import Ragged


def _floating(x: Any) -> bool:
    values = x.values if isinstance(x, Ragged) else x
    return isinstance(values, Tensor) and values.is_floating_point()


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def check_jvp_against_loop(
    op: Callable[..., Any],
    ref: Callable[..., Any],
    *inputs: Any,
    dual: bool = False,
    nan_tangent_is_zero: bool = False,
    nan_tangent_as_loop: bool = False,
    **tolerances: Any,
) -> None:
    """The jvp of ``op(*inputs)`` equals ``[jvp of ref(*sample_i)]``, outputs and tangents.

    Every floating input gets a random tangent: a ``Ragged`` one with its
    partition (cut per sample for the reference), a dense tensor one shared by
    all samples. ``dual=False`` differentiates with ``torch.func.jvp``,
    ``dual=True`` with ``torch.autograd.forward_ad`` dual tensors. The
    reference side always uses ``torch.func.jvp`` on each sample, with torch's
    math SDPA backend (its fused CPU kernel has no forward-mode rule). Runs with
    the default bucket plan and with one bucket per distinct size.

    Tangents are compared where the expected output is finite (policy values
    such as the -inf max of an empty sample have none; raggedfn's tangent must
    be finite there). ``nan_tangent_as_loop``: where the output is not finite,
    raggedfn's tangent is NaN exactly where the loop's is and finite elsewhere
    (the NaN mean of an empty sample: torch's tangent is NaN too).
    ``nan_tangent_is_zero``: where torch's tangent is NaN at a finite output
    (``std`` of one element) raggedfn's is 0, as its gradient.
    """
    flags = (nan_tangent_is_zero, nan_tangent_as_loop)
    _check(op, ref, inputs, dual, flags, tolerances)
    with tight_buckets():
        _check(op, ref, inputs, dual, flags, tolerances)


def _check(
    op: Callable[..., Any],
    ref: Callable[..., Any],
    inputs: Sequence[Any],
    dual: bool,
    flags: tuple[bool, bool],
    tolerances: dict[str, Any],
) -> None:
    nan_tangent_is_zero, nan_tangent_as_loop = flags
    gen = torch.Generator().manual_seed(4321)
    positions = [n for n, x in enumerate(inputs) if _floating(x)]
    primals = [
        (inputs[n].values if isinstance(inputs[n], Ragged) else inputs[n]).detach()
        for n in positions
    ]
    tangents = [
        torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in primals
    ]

    def rebuild(values: Sequence[Tensor]) -> list[Any]:
        args = list(inputs)
        for n, v in zip(positions, values, strict=True):
            x = inputs[n]
            args[n] = x.with_values(v) if isinstance(x, Ragged) else v
        return args

    def flat(*values: Tensor) -> tuple[Tensor, ...]:
        outs = _as_tuple(op(*rebuild(values)))
        return tuple(o.values if isinstance(o, Ragged) else o for o in outs)

    structure = _as_tuple(op(*rebuild(primals)))  # partitions of the outputs
    if dual:
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
            unpacked = [fwAD.unpack_dual(o) for o in flat(*duals)]
            out_values = tuple(u.primal for u in unpacked)
            out_tangents = tuple(
                torch.zeros_like(u.primal) if u.tangent is None else u.tangent for u in unpacked
            )
    else:
        out_values, out_tangents = torch.func.jvp(flat, tuple(primals), tuple(tangents))

    per_sample = [samples(x) if isinstance(x, Ragged) else None for x in inputs]
    tangent_cuts = {
        n: samples(inputs[n].with_values(t)) if isinstance(inputs[n], Ragged) else None
        for n, t in zip(positions, tangents, strict=True)
    }
    batch = next(x.batch_size for x in inputs if isinstance(x, Ragged))
    expected_values: list[tuple[Tensor, ...]] = []
    expected_tangents: list[tuple[Tensor, ...]] = []
    for i in range(batch):
        args = [p[i] if p is not None else x for p, x in zip(per_sample, inputs, strict=True)]
        sample_primals = tuple(args[n] for n in positions)
        sample_tangents = tuple(
            cut[i] if cut is not None else tangents[positions.index(n)]
            for n, cut in tangent_cuts.items()
        )

        def one(*values: Tensor, args: list[Any] = args) -> tuple[Tensor, ...]:
            call = list(args)
            for n, v in zip(positions, values, strict=True):
                call[n] = v
            return _as_tuple(ref(*call))

        with sdpa_kernel(SDPBackend.MATH):
            value, tangent = torch.func.jvp(one, sample_primals, sample_tangents)
        expected_values.append(value)
        expected_tangents.append(tangent)

    for n, out in enumerate(structure):
        wrap = out.with_values if isinstance(out, Ragged) else (lambda v: v)
        values = [e[n] for e in expected_values]
        assert_same(wrap(out_values[n]), values, **tolerances)
        if not out_values[n].is_floating_point():
            continue
        got = wrap(out_tangents[n])
        got_samples = samples(got) if isinstance(got, Ragged) else list(got.unbind(0))
        for i, (g, want, value) in enumerate(
            zip(got_samples, [e[n] for e in expected_tangents], values, strict=True)
        ):
            # policy values (-inf max of an empty extent...) have no tangent to compare;
            # raggedfn's must still be finite there (DESIGN §4), or NaN where the loop's
            # is (nan_tangent_as_loop: the NaN mean of an empty extent, as torch's)
            settled = torch.isfinite(value)
            nan = ~settled & want.isnan() if nan_tangent_as_loop else torch.zeros_like(settled)
            assert g[nan].isnan().all(), f"sample {i}: the loop's tangent is NaN, not this"
            assert torch.isfinite(g[~settled & ~nan]).all(), f"sample {i}: non-finite tangent"
            g = torch.where(settled, g, torch.zeros_like(g))
            want = torch.where(settled, want, torch.zeros_like(want))
            if nan_tangent_is_zero:
                want = torch.nan_to_num(want, nan=0.0)
            assert g.shape == want.shape, (i, g.shape, want.shape)
            torch.testing.assert_close(
                g, want, msg=lambda m, i=i: f"tangent of sample {i}: {m}", **tolerances
            )
