"""torch.compile of models over nested values and of the expert layer: equal to eager,
no graph break, and new lengths (new structures, new routings) reuse the graph."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

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


# ----- nested and rectangular axes in one value ------------------------------------------


def pair_documents(seed: int, shape: list[list[int]]) -> raggedfn.Ragged:
    """Documents of sentences, each with an ``L x L x 4`` pair state: ``r0 n1 r2 d0``."""
    gen = torch.Generator().manual_seed(seed)
    docs = [[torch.randn(n, n, 4, generator=gen) for n in doc] for doc in shape]
    return raggedfn.from_list(docs, ragged_dims=(1, 2, 3))


def edge_grids(seed: int, nodes: list[int]) -> raggedfn.Ragged:
    """Per graph an ``N x N`` grid of node pairs, each with its edges: ``r0 r1 n2 d0``."""
    gen = torch.Generator().manual_seed(seed)
    per_pair = [int(c) for n in nodes for c in torch.randint(0, 4, (n * n,), generator=gen)]
    per_node = [n for n in nodes for _ in range(n)]
    values = torch.randn(sum(per_pair), 4, generator=gen)
    return raggedfn.from_nested_lengths(values, [nodes, per_node, per_pair], rectangular_dims=(2,))


def pair_pooling(x: raggedfn.Ragged, w: torch.Tensor) -> torch.Tensor:
    """Attention along the last ragged axis, then sums down to a scalar."""
    weighted = x * w
    pooled = raggedfn.sum(raggedfn.softmax(weighted, 3) * weighted, 3)
    return (
        raggedfn.sum(pooled, 2).values.pow(2).sum()
        if pooled.is_nested
        else pooled.values.pow(2).sum()
    )


def test_mixed_values_compile_to_one_graph() -> None:
    """Lists of rectangles and rectangles of lists: one graph each, new structures reuse it
    (the sum over a grid's edge lists gives an ordinary pair state inside the graph)."""
    for make, shapes in (
        (pair_documents, DOCS),
        (edge_grids, ([3, 4, 2, 5, 6], [2, 3], [4, 0, 3, 2], [5, 2, 3])),
    ):
        fresh()
        w = torch.randn(4, requires_grad=True)
        compiled = torch.compile(pair_pooling, fullgraph=True, dynamic=True)
        for seed, shape in enumerate(shapes):
            x = make(seed, shape)
            _assert_grads(compiled(x, w), pair_pooling(x, w), {"w": w})
        assert graphs() == (1, 0)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_cat_of_nested_values_compiles_to_one_graph(dim: int) -> None:
    """cat along a nested or dense axis of documents: sizes from tensor shapes, no
    host sync, so new structures reuse the graph."""
    fresh()
    w = torch.randn(4 if dim < 3 else 8, dtype=torch.float64, requires_grad=True)

    def joined(x: raggedfn.Ragged, y: raggedfn.Ragged) -> torch.Tensor:
        out = raggedfn.cat([x, y], dim)
        return (raggedfn.sum(raggedfn.softmax(out, 2), 2).values @ w).pow(2).sum()

    compiled = torch.compile(joined, fullgraph=True, dynamic=True)
    for seed, shape in enumerate(DOCS):
        x = raggedfn.from_list(documents(seed, shape))
        other = shape if dim == 3 else [[n + 1 for n in doc] for doc in shape]
        y = raggedfn.from_list(documents(10 + seed, other))
        if dim == 1:  # other sentences (another count: no duck-sized equality), same documents
            y = raggedfn.from_list(documents(10 + seed, [[2] * (len(d) % 2 + 1) for d in shape]))
        _assert_grads(compiled(x, y), joined(x, y), {"w": w})
    assert graphs() == (1, 0)


# ----- a dense weight on nested values ---------------------------------------------------

# new batch sizes and lengths every batch (B = 5, 4, 3, 6): each would recompile if
# x @ w read a size
WEIGHTED_DOCS = [*DOCS[:3], [[1, 1, 1], [9, 2], [2, 3], [4], [3, 3], [2, 2, 2]]]


def _attention_pool(scores: torch.Tensor) -> torch.Tensor:
    """One sentence's (or document's) ``[n, *E]`` scores pooled over its ``n`` tokens."""
    return (torch.softmax(scores, 0) * scores).sum(0).pow(2).sum()


@pytest.mark.parametrize("weight_shape", [(4,), (4, 3)])
@pytest.mark.parametrize("nested", [True, False])
def test_dense_weight_on_nested_values_compiles_once(
    weight_shape: tuple[int, ...], nested: bool
) -> None:
    """Attention pooling of ``x @ w`` over the tokens of every sentence, ``w`` a ``[D]``
    or ``[D, E]`` tensor: dynamo hands ``x @ w`` to ``Ragged`` as ``Tensor.matmul(w, x)``,
    and telling ``w @ x`` from ``x @ w`` reads no size, so new batch sizes and lengths
    reuse one graph; values and gradients equal the per-sentence loop (one level: the
    documents' tokens joined, pooled per document)."""
    fresh()
    w = torch.randn(*weight_shape, dtype=torch.float64, requires_grad=True)
    axis = 2 if nested else 1

    def pooled(x: raggedfn.Ragged) -> torch.Tensor:
        scores = x @ w
        out = raggedfn.sum(raggedfn.softmax(scores, axis) * scores, axis)
        return (out.values if isinstance(out, raggedfn.Ragged) else out).pow(2).sum()

    compiled = torch.compile(pooled, fullgraph=True, dynamic=True)
    zero = torch.zeros((), dtype=torch.float64)
    for seed, shape in enumerate(WEIGHTED_DOCS):
        docs = documents(seed, shape)
        x = raggedfn.from_list(docs)
        if nested:
            expected = sum((_attention_pool(s @ w) for doc in docs for s in doc), zero)
        else:
            x = raggedfn.flatten(x, 1, 2)
            joined = [torch.cat(doc) for doc in docs if doc]
            expected = sum((_attention_pool(t @ w) for t in joined), zero)
        _assert_grads(compiled(x), expected, {"w": w})
    assert graphs() == (1, 0)


@pytest.mark.parametrize("equation", ["bstd,bsud->bstu", "bstd,bsud->bsut"])
def test_per_sentence_einsum_compiles_once(equation: str) -> None:
    """A pair state per sentence of two documents batches with the same sentences and
    other tokens, softmax over its last axis: one graph for new batch sizes and lengths,
    values and gradients equal to the per-sentence einsum."""
    fresh()
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    inner = equation.split(",")[0][2:] + "," + equation.split(",")[1][2:].split("-")[0]
    inner += "->" + equation[-2:]

    def pooled(x: raggedfn.Ragged, y: raggedfn.Ragged) -> torch.Tensor:
        pairs = raggedfn.einsum(equation, x * w, y)
        return (raggedfn.softmax(pairs, 3) * pairs).values.pow(2).sum()

    unbacked: set[object] = set()

    def backend(gm: torch.fx.GraphModule, _inputs: object) -> object:
        for node in gm.graph.nodes:
            unbacked.update(free_unbacked_symbols(node.meta.get("example_value")))
        return gm.forward

    compiled = torch.compile(pooled, fullgraph=True, dynamic=True, backend=backend)
    zero = torch.zeros((), dtype=torch.float64)
    for seed, shape in enumerate(WEIGHTED_DOCS):
        other = [[n + 1 + k % 2 for k, n in enumerate(doc)] for doc in shape]
        xs, ys = documents(seed, shape), documents(10 + seed, other)
        x, y = raggedfn.from_list(xs), raggedfn.from_list(ys)
        expected = sum(
            (
                ((p := torch.einsum(inner, s * w, t)).softmax(-1) * p).pow(2).sum()
                for dx, dy in zip(xs, ys, strict=True)
                for s, t in zip(dx, dy, strict=True)
            ),
            zero,
        )
        _assert_grads(compiled(x, y), expected, {"w": w})
    assert graphs() == (1, 0)
    # one data-dependent size: the pair state's row count (sum of t * u); the lengths
    # put back under the documents come from shapes (no repeat without its size)
    assert len(unbacked) == 1, unbacked
