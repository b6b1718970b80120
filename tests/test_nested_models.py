"""Models over nested ragged values: a GAT layer over graphs -> nodes -> incoming edges and
a two-level document encoder (documents -> sentences -> tokens), each equal to the
per-graph / per-document loop in values and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import raggedfn

HEADS, IN, OUT = 2, 5, 3


# ----- graphs: a GAT layer ---------------------------------------------------------------


def graph_batch(seed: int, nodes: list[int], density: float = 0.5):
    """Random graphs (some without edges, one without nodes) as PyG-style tensors."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(sum(nodes), IN, generator=gen, dtype=torch.float64)
    src, dst, start = [], [], 0
    for n in nodes:
        for i in range(n):
            for j in range(n):
                if float(torch.rand((), generator=gen)) < density:
                    src.append(start + j)  # an edge j -> i
                    dst.append(start + i)
        start += n
    edge_index = torch.tensor([src, dst], dtype=torch.int64).reshape(2, -1)
    return features, edge_index


def gat_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def param(*shape: int) -> torch.Tensor:
        return (0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_(True)

    return {"weight": param(IN, HEADS * OUT), "src": param(HEADS, OUT), "dst": param(HEADS, OUT)}


def incoming_edges(edge_index: torch.Tensor, nodes: list[int]) -> raggedfn.Ragged:
    """Source node of every edge as graphs -> nodes -> incoming edges ``(B, N*, E*)``."""
    total = sum(nodes)
    by_target, _ = raggedfn.group_by(edge_index[0], edge_index[1], total)
    return raggedfn.from_nested_lengths(by_target.values, [nodes, by_target.lengths])


def gat(
    features: torch.Tensor, edges: raggedfn.Ragged, p: dict[str, torch.Tensor]
) -> raggedfn.Ragged:
    """One GAT layer: softmax over each node's incoming edges, weighted sum of sources."""
    z = (features @ p["weight"]).reshape(-1, HEADS, OUT)  # [N, H, F]
    source = edges.with_values(z.index_select(0, edges.values))  # (B, N*, E*, H, F)
    from_source = raggedfn.sum(source * p["src"], -1)  # (B, N*, E*, H)
    # the target's score, a node-level value broadcast to its incoming edges
    nodes = raggedfn.sum(edges, 2).with_values((z * p["dst"]).sum(-1))  # (B, N*, H)
    logits = raggedfn.apply(F.leaky_relu, from_source + raggedfn.unsqueeze(nodes, 2), 0.2)
    alpha = raggedfn.softmax(logits, 2)  # over incoming edges
    return raggedfn.sum(raggedfn.unsqueeze(alpha, -1) * source, 2)  # (B, N*, H, F)


def gat_loop(features: torch.Tensor, edge_index: torch.Tensor, nodes: list[int], p) -> list:
    """Graph by graph, node by node, with plain torch."""
    z = (features @ p["weight"]).reshape(-1, HEADS, OUT)
    out, start = [], 0
    for n in nodes:
        rows = []
        for i in range(start, start + n):
            srcs = edge_index[0][edge_index[1] == i]
            if srcs.numel() == 0:
                rows.append(torch.zeros(HEADS, OUT, dtype=z.dtype))
                continue
            logits = F.leaky_relu((z[srcs] * p["src"]).sum(-1) + (z[i] * p["dst"]).sum(-1), 0.2)
            alpha = torch.softmax(logits, 0)  # [E_i, H]
            rows.append((alpha.unsqueeze(-1) * z[srcs]).sum(0))
        out.append(torch.stack(rows) if rows else z.new_zeros(0, HEADS, OUT))
        start += n
    return out


def test_gat_layer_equals_the_per_graph_loop_with_gradients() -> None:
    nodes = [4, 0, 3, 5, 1]
    features, edge_index = graph_batch(0, nodes)
    features.requires_grad_(True)
    p = gat_params()
    edges = incoming_edges(edge_index, nodes)
    raggedfn.check(edges)
    got = gat(features, edges, p)
    expected = gat_loop(features, edge_index, nodes, p)
    assert got.shape == (len(nodes), None, HEADS, OUT) and got.lengths.tolist() == nodes
    for i, e in enumerate(expected):
        torch.testing.assert_close(got[i], e)
    wrt = [features, *p.values()]
    mine = torch.autograd.grad((got.values**2).sum(), wrt)
    theirs = torch.autograd.grad(sum((e**2).sum() for e in expected), wrt)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b)


# ----- documents: a two-level encoder ----------------------------------------------------------

DIM = 4


def encoder_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def param(*shape: int) -> torch.Tensor:
        return (0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_(True)

    return {"token": param(DIM, DIM), "token_score": param(DIM), "sentence_score": param(DIM)}


def encode(docs: raggedfn.Ragged, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Attention pooling of tokens into sentences, then of sentences into documents."""
    h = raggedfn.apply(torch.tanh, raggedfn.linear(docs, p["token"]))  # (B, S*, L*, D)
    token_weight = raggedfn.softmax(raggedfn.sum(h * p["token_score"], -1, keepdim=True), 2)
    sentences = raggedfn.sum(token_weight * h, 2)  # (B, S*, D)
    sentences = raggedfn.layer_norm(sentences, DIM)
    sentence_weight = raggedfn.softmax(
        raggedfn.sum(sentences * p["sentence_score"], -1, keepdim=True), 1
    )
    return raggedfn.sum(sentence_weight * sentences, 1)  # (B, D)


def encode_loop(documents: list[list[torch.Tensor]], p: dict[str, torch.Tensor]) -> torch.Tensor:
    out = []
    for sentences in documents:
        vectors = []
        for tokens in sentences:
            h = torch.tanh(tokens @ p["token"].T)
            weight = torch.softmax((h * p["token_score"]).sum(-1, keepdim=True), 0)
            vectors.append((weight * h).sum(0))
        if not vectors:
            out.append(torch.zeros(DIM, dtype=torch.float64))
            continue
        s = F.layer_norm(torch.stack(vectors), (DIM,))
        weight = torch.softmax((s * p["sentence_score"]).sum(-1, keepdim=True), 0)
        out.append((weight * s).sum(0))
    return torch.stack(out)


def documents(seed: int, shape: list[list[int]]) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, DIM, generator=gen, dtype=torch.float64) for n in doc] for doc in shape]


def test_document_encoder_equals_the_per_document_loop_with_gradients() -> None:
    shape = [[3, 1, 4], [], [2], [5, 2]]
    docs = documents(0, shape)
    x = raggedfn.from_list(docs)
    x = x.with_values(x.values.detach().requires_grad_(True))
    p = encoder_params()
    got, expected = encode(x, p), encode_loop(docs, p)
    torch.testing.assert_close(got, expected)
    mine = torch.autograd.grad(got.pow(2).sum(), list(p.values()))
    theirs = torch.autograd.grad(expected.pow(2).sum(), list(p.values()))
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b)
