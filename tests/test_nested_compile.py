"""torch.compile of models over nested values and of the expert layer: equal to eager,
no graph break, and new lengths (new structures, new routings) reuse the graph."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import raggedfn
from tests.test_grouped import moe, moe_params, moe_tokens
from tests.test_nested_models import (
    documents,
    encode,
    encoder_params,
    gat,
    gat_params,
    graph_batch,
    incoming_edges,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


def fresh() -> None:
    torch._dynamo.reset()
    counters.clear()


def graphs() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _assert_grads(loss, expected, params) -> None:
    torch.testing.assert_close(loss, expected)
    for a, b in zip(
        torch.autograd.grad(loss, list(params.values())),
        torch.autograd.grad(expected, list(params.values())),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


# document shapes: the first batch sets the graph, so no size there is 0 or 1 or equals
# another (B = 5, B + 1 = 6, S + 1 = 11, T = 32, D = 4): dynamo would unify equal sizes
DOCS = [
    [[3, 2, 4], [2, 5], [3], [6, 2], [2, 3]],
    [[2, 6], [4, 2, 3, 2], [], [5]],
    [[7], [2, 2], [3, 0, 4]],
    [[1, 1, 1], [9, 2]],
]


def test_document_encoder_compiles_to_one_graph() -> None:
    fresh()
    p = encoder_params(1)
    compiled = torch.compile(lambda x: encode(x, p).pow(2).sum(), fullgraph=True, dynamic=True)
    for seed, shape in enumerate(DOCS):
        x = raggedfn.from_list(documents(seed, shape))
        _assert_grads(compiled(x), encode(x, p).pow(2).sum(), p)
    assert graphs() == (1, 0)


def test_gat_layer_compiles_to_one_graph() -> None:
    fresh()
    p = gat_params(1)

    def loss(features, edges):
        return gat(features, edges, p).values.pow(2).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    # the first batch: B = 7, no size equal to another (IN 5, H 2, F 3, H * F 6) or 0/1
    for seed, nodes in enumerate(([4, 3, 5, 2, 6, 7, 4], [2, 6, 0, 3], [5, 5], [3, 2, 4, 2])):
        features, edge_index = graph_batch(seed, nodes)
        edges = incoming_edges(edge_index, nodes)
        _assert_grads(compiled(features, edges), loss(features, edges), p)
    assert graphs() == (1, 0)


def test_moe_layer_compiles_to_one_graph() -> None:
    """group_by and the scatter back trace; segment_matmul is one opaque node; new token
    counts and routings reuse the graph."""
    fresh()
    p = moe_params(2)
    compiled = torch.compile(lambda x: moe(x, p).pow(2).sum(), fullgraph=True, dynamic=True)
    for seed, count in enumerate((23, 31, 17, 40)):
        x = moe_tokens(seed, count).detach()
        _assert_grads(compiled(x), moe(x, p).pow(2).sum(), p)
    assert graphs() == (1, 0)
