"""``matmul`` of Ragged operands for every pair of sample ranks, as ``torch.matmul`` per sample.

Each rank pair takes its own subscripts (``ops._matmul._matmul_subscripts``):
vector-vector (a dot product, dense result), vector-matrix, matrix-vector and
matrix-matrix, with the contracted axis ragged or dense, and with leading (batch) axes.
"""

from __future__ import annotations

import pytest
import torch

import raggedfn
from raggedfn import Ragged

LENGTHS = [3, 0, 4]


def _ragged(shape_of: list[tuple[int, ...]], seed: int) -> Ragged:
    gen = torch.Generator().manual_seed(seed)
    ragged = tuple(a + 1 for a in range(len(shape_of[0])) if len({s[a] for s in shape_of}) > 1)
    return raggedfn.from_list(
        [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shape_of],
        ragged_dims=ragged,
    )


def _samples(x: Ragged | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(x, Ragged):
        return [x[b] for b in range(x.batch_size)]
    return list(x.unbind(0))


SHARED_VECTOR = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
SHARED_MATRIX = torch.linspace(-1.0, 1.0, 10, dtype=torch.float64).reshape(5, 2)
CASES = {  # per-sample shapes of a, and of b (or one tensor that every sample shares)
    "vector-vector": ([(n,) for n in LENGTHS], [(n,) for n in LENGTHS]),
    "vector-matrix": ([(n,) for n in LENGTHS], [(n, 2) for n in LENGTHS]),
    "matrix-vector": ([(n, 5) for n in LENGTHS], SHARED_VECTOR),
    "matrix-matrix": ([(n, 5) for n in LENGTHS], SHARED_MATRIX),
    # leading (batch) axes of torch.matmul: each rank pair has its own letters
    "vector-batched": ([(n,) for n in LENGTHS], [(2, 3, n, 2) for n in LENGTHS]),
    "batched-vector": ([(2, 3, n, 5) for n in LENGTHS], SHARED_VECTOR),
    "batched-matrix": ([(2, n, 5) for n in LENGTHS], SHARED_MATRIX),
    "batched-batched": ([(2, n, 5) for n in LENGTHS], [(2, 5, n) for n in LENGTHS]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matmul_equals_torch_matmul_per_sample(case: str) -> None:
    shapes_a, shapes_b = CASES[case]
    a = _ragged(shapes_a, 0)
    b = shapes_b if isinstance(shapes_b, torch.Tensor) else _ragged(shapes_b, 1)
    out = raggedfn.matmul(a, b)
    got = _samples(out)
    others = [b] * a.batch_size if isinstance(b, torch.Tensor) else _samples(b)
    want = [torch.matmul(x, y) for x, y in zip(_samples(a), others, strict=True)]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)
