"""examples/gat.py: its GAT layer against a dense per-graph reference and PyG; the example runs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import raggedfn
from examples import gat

F64 = torch.float64


def graphs(seed: int = 0, count: int = 4) -> gat.GraphBatch:
    gen = torch.Generator().manual_seed(seed)
    out = gat.make_batch(gen, count, 2, 9)
    return gat.GraphBatch(out.x.to(F64), out.edge_index, out.batch, out.ptr, out.y)


def layer(in_channels: int = 2, out_channels: int = 3, heads: int = 2) -> gat.GATConv:
    torch.manual_seed(0)
    conv = gat.GATConv(in_channels, out_channels, heads).double()
    with torch.no_grad():
        conv.bias.normal_()
    return conv


def dense_gat(conv: gat.GATConv, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
    """One graph, written densely: ``adjacency[i, j]`` True when there is an edge j -> i."""
    n, heads, d = x.shape[0], conv.heads, conv.out_channels
    h = conv.lin(x).view(n, heads, d)
    source = (h * conv.att_src).sum(-1)  # [n, H]
    target = (h * conv.att_dst).sum(-1)
    scores = F.leaky_relu(target[:, None, :] + source[None, :, :], 0.2)  # [i, j, H]
    scores = scores.masked_fill(~adjacency[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=1).nan_to_num(0.0)  # a node without edges: 0
    return torch.einsum("ijh,jhd->ihd", weights, h).reshape(n, heads * d) + conv.bias


def per_graph_reference(conv: gat.GATConv, batch: gat.GraphBatch, self_loops: bool) -> torch.Tensor:
    outs = []
    ptr = batch.ptr.tolist()
    for g in range(len(ptr) - 1):
        start, stop = ptr[g], ptr[g + 1]
        inside = (batch.edge_index[1] >= start) & (batch.edge_index[1] < stop)
        source, target = batch.edge_index[:, inside] - start
        adjacency = torch.zeros(stop - start, stop - start, dtype=torch.bool)
        adjacency[target, source] = True
        if self_loops:
            adjacency |= torch.eye(stop - start, dtype=torch.bool)
        outs.append(dense_gat(conv, batch.x[start:stop], adjacency))
    return torch.cat(outs)


@pytest.mark.parametrize("self_loops", [True, False])
def test_gat_layer_equals_a_dense_per_graph_reference(self_loops):
    conv, batch = layer(), graphs()
    edges = gat.incoming_edges(batch.edge_index, batch.x.shape[0], self_loops=self_loops)
    x = batch.x.clone().requires_grad_()
    got = conv(x, edges)
    x_ref = batch.x.clone().requires_grad_()
    want = per_graph_reference(
        conv, gat.GraphBatch(x_ref, batch.edge_index, batch.batch, batch.ptr, batch.y), self_loops
    )
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    cotangent = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, *conv.parameters()], cotangent)
    grads_ref = torch.autograd.grad(want, [x_ref, *conv.parameters()], cotangent)
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)


def test_a_node_without_incoming_edges_gets_the_bias():
    conv = layer()
    x = torch.randn(3, 2, dtype=F64)
    edges = gat.incoming_edges(torch.tensor([[0], [1]]), 3, self_loops=False)
    assert edges.lengths.tolist() == [0, 1, 0]
    out = conv(x, edges)
    torch.testing.assert_close(out[0], conv.bias.detach())
    torch.testing.assert_close(out[2], conv.bias.detach())


def test_incoming_edges_group_sources_by_target():
    edge_index = torch.tensor([[2, 0, 1, 2], [1, 2, 2, 0]])
    edges = gat.incoming_edges(edge_index, 4, self_loops=False)
    assert edges.lengths.tolist() == [1, 1, 2, 0]
    assert edges.values.tolist() == [2, 2, 0, 1]
    assert raggedfn.segment_ids(edges).tolist() == [0, 1, 2, 2]


def test_collate_follows_the_batch_conventions():
    batch = graphs(count=3)
    counts = (batch.ptr[1:] - batch.ptr[:-1]).tolist()
    assert batch.batch.tolist() == [g for g, n in enumerate(counts) for _ in range(n)]
    assert torch.equal(raggedfn.segment_ids(raggedfn.from_offsets(batch.x, batch.ptr)), batch.batch)
    # every edge stays inside its graph
    assert torch.equal(batch.batch[batch.edge_index[0]], batch.batch[batch.edge_index[1]])


def _pyg():
    with warnings.catch_warnings():
        # torch 2.13 deprecates torch.jit.script, which PyG calls while importing
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("torch_geometric")


def test_gat_layer_equals_pyg_gatconv():
    pyg = _pyg()
    conv, batch = layer(), graphs(seed=3)
    theirs = pyg.nn.GATConv(2, 3, heads=2).double()
    theirs.load_state_dict(conv.state_dict())
    edges = gat.incoming_edges(batch.edge_index, batch.x.shape[0], self_loops=True)
    torch.testing.assert_close(conv(batch.x, edges), theirs(batch.x, batch.edge_index))


def test_collate_equals_pyg_batch():
    pyg = _pyg()
    gen = torch.Generator().manual_seed(4)
    parts = [gat.make_graph(gen, n) for n in (3, 6, 4)]
    ours = gat.collate(parts)
    data = [pyg.data.Data(x=x, edge_index=e, y=y) for x, e, y in parts]
    theirs = pyg.data.Batch.from_data_list(data)
    for name in ("x", "edge_index", "batch", "ptr", "y"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


def test_example_trains_at_a_small_size(capsys):
    args = ["--steps", "40", "--graphs", "8", "--max-nodes", "12", "--threads", "1"]
    assert gat.main([*args, "--min-accuracy", "0.7"]) == 0
    assert "held-out node accuracy" in capsys.readouterr().out


def test_example_fails_below_the_accuracy_threshold(capsys):
    args = ["--steps", "1", "--graphs", "2", "--max-nodes", "6", "--threads", "1"]
    assert gat.main([*args, "--min-accuracy", "1.01"]) == 1
    assert "FAILED" in capsys.readouterr().out
