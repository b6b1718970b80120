"""A graph attention network (GAT) over PyG-style graph batches, with raggedfn's segment ops.

A batch of graphs in PyTorch Geometric's conventions is one big disconnected graph:
node features ``x [N, F]`` of every graph stacked, ``edge_index [2, E]`` (source
row, target row, node numbers already shifted by each graph's first node),
``batch [N]`` (the graph of every node, sorted) and ``ptr [G + 1]`` (offsets of
the graphs' nodes). raggedfn reads both groupings as ragged values:

- the incoming edges of every node, ``(N, in_degree*, ...)``: GAT's attention is
  a softmax over them (``raggedfn.softmax``) and its message passing a sum over
  them (``raggedfn.sum``), each a segment primitive with its own backward rule;
- the nodes of every graph, ``raggedfn.from_offsets(h, ptr)``, ``(G, nodes*, ...)``:
  per-graph readouts are reductions over its ragged axis.

The task: nodes are red or blue; a node's label says whether most of its
neighbours are red, so the model has to attend over its edges. ``GATConv`` below
follows ``torch_geometric.nn.GATConv``'s parametrisation (``lin``, ``att_src``,
``att_dst``, ``bias``, LeakyReLU 0.2, self-loops), and the test suite checks it
against a dense per-graph reference and, where ``torch-geometric`` is installed
(the ``pyg`` extra), against PyG's own layer.

Run ``python examples/gat.py --help`` for the knobs; the defaults train in about
a minute on a CPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import raggedfn

# torch 2.13 warns when its own code instantiates the autograd.Function of a segment
# primitive under torch.func; harmless (the test suite filters it the same way)
warnings.filterwarnings(
    "ignore", message=".*should not be instantiated", category=DeprecationWarning
)


@dataclass(frozen=True)
class GraphBatch:
    """A batch of graphs in PyG's conventions (``torch_geometric.data.Batch``'s fields)."""

    x: Tensor  # [N, F] node features of every graph, stacked
    edge_index: Tensor  # int64 [2, E]: (source, target) rows, global node numbers
    batch: Tensor  # int64 [N]: graph of every node, sorted
    ptr: Tensor  # int64 [G + 1]: graph g owns nodes ptr[g]:ptr[g + 1]
    y: Tensor  # int64 [N] node labels


def make_graph(gen: torch.Generator, nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """One random undirected graph: ``(x [n, 2] one-hot colour, edge_index [2, e], y [n])``.

    A ring (so nobody is alone) plus random chords, without duplicate edges.
    """
    red = torch.rand(nodes, generator=gen) < 0.5
    x = torch.stack([red, ~red], dim=1).to(torch.float32)
    ring = torch.arange(nodes)
    src = [ring, torch.randint(0, nodes, (nodes,), generator=gen)]
    dst = [(ring + 1) % nodes, torch.randint(0, nodes, (nodes,), generator=gen)]
    pairs = torch.stack([torch.cat(src), torch.cat(dst)])
    pairs = pairs[:, pairs[0] != pairs[1]]
    both = torch.cat([pairs, pairs.flip(0)], dim=1)  # undirected: both directions
    edge_index = torch.unique(both, dim=1)  # sorted, no duplicates
    target, source = edge_index[1], edge_index[0]
    red_neighbours = torch.zeros(nodes).index_add_(0, target, red[source].float())
    degree = torch.zeros(nodes).index_add_(0, target, torch.ones_like(target, dtype=torch.float))
    y = (2 * red_neighbours > degree).to(torch.int64)
    return x, edge_index, y


def collate(graphs: list[tuple[Tensor, Tensor, Tensor]]) -> GraphBatch:
    """Stack graphs the way ``torch_geometric.data.Batch.from_data_list`` does."""
    counts = torch.tensor([x.shape[0] for x, _, _ in graphs])
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    edge_index = torch.cat([e + ptr[g] for g, (_, e, _) in enumerate(graphs)], dim=1)
    return GraphBatch(
        x=torch.cat([x for x, _, _ in graphs]),
        edge_index=edge_index,
        batch=torch.repeat_interleave(torch.arange(len(graphs)), counts),
        ptr=ptr,
        y=torch.cat([y for _, _, y in graphs]),
    )


def make_batch(gen: torch.Generator, graphs: int, min_nodes: int, max_nodes: int) -> GraphBatch:
    sizes = torch.randint(min_nodes, max_nodes + 1, (graphs,), generator=gen)
    return collate([make_graph(gen, int(n)) for n in sizes])


def incoming_edges(edge_index: Tensor, num_nodes: int, self_loops: bool) -> raggedfn.Ragged:
    """The source node of every edge, grouped by target: int64 ``(N, in_degree*)``.

    Built once per batch; each layer puts its per-edge tensors on the same
    partition with ``with_values`` (no copy of the grouping, no validation).
    """
    source, target = edge_index[0], edge_index[1]
    if self_loops:
        nodes = torch.arange(num_nodes, device=edge_index.device)
        source, target = torch.cat([source, nodes]), torch.cat([target, nodes])
    order = torch.argsort(target, stable=True)
    in_degree = torch.bincount(target, minlength=num_nodes)
    return raggedfn.from_lengths(source[order], in_degree)


class GATConv(nn.Module):
    """One graph attention layer (Velickovic et al.), PyG's ``GATConv`` parametrisation.

    ``out_i = sum_{j -> i} softmax_j(LeakyReLU(a_src . W x_j + a_dst . W x_i)) W x_j + bias``
    per head; heads are concatenated.
    """

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1) -> None:
        super().__init__()
        self.heads, self.out_channels = heads, out_channels
        self.lin = nn.Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.bias = nn.Parameter(torch.zeros(heads * out_channels))
        bound = math.sqrt(6.0 / (heads + out_channels))
        nn.init.uniform_(self.att_src, -bound, bound)
        nn.init.uniform_(self.att_dst, -bound, bound)

    def forward(self, x: Tensor, edges: raggedfn.Ragged) -> Tensor:
        """``x [N, F]``, ``edges`` from :func:`incoming_edges` -> ``[N, heads * out]``."""
        h = self.lin(x).view(-1, self.heads, self.out_channels)  # [N, H, D]
        source = edges.values  # [E]: edges sorted by target node
        target = raggedfn.segment_ids(edges)  # [E]: PyG's edge_index[1], in that order
        alpha_src = (h * self.att_src).sum(-1)  # [N, H]
        alpha_dst = (h * self.att_dst).sum(-1)
        scores = F.leaky_relu(alpha_src[source] + alpha_dst[target], 0.2)  # [E, H]
        weights = raggedfn.softmax(edges.with_values(scores), dim=1)  # (N, deg*, H)
        messages = edges.with_values(weights.values.unsqueeze(-1) * h[source])  # (N, deg*, H, D)
        out = raggedfn.sum(messages, dim=1)  # [N, H, D]; a node without edges gets 0
        return out.reshape(-1, self.heads * self.out_channels) + self.bias


class GAT(nn.Module):
    """Two GAT layers (ELU between them) and a linear node classifier."""

    def __init__(self, in_channels: int = 2, hidden: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.conv1 = GATConv(in_channels, hidden, heads)
        self.conv2 = GATConv(heads * hidden, hidden, heads)
        self.skip = nn.Linear(in_channels, heads * hidden)
        self.classify = nn.Linear(heads * hidden, 2)

    def forward(self, graphs: GraphBatch) -> Tensor:
        """Node logits ``[N, 2]``."""
        edges = incoming_edges(graphs.edge_index, graphs.x.shape[0], self_loops=True)
        h = F.elu(self.conv1(graphs.x, edges) + self.skip(graphs.x))
        h = F.elu(self.conv2(h, edges) + h)
        return self.classify(h)


def per_graph_accuracy(logits: Tensor, graphs: GraphBatch) -> Tensor:
    """``[G]`` accuracy of every graph: a mean over the ragged node axis (PyG's ``ptr``)."""
    correct = (logits.argmax(-1) == graphs.y).to(logits.dtype)
    return raggedfn.mean(raggedfn.from_offsets(correct, graphs.ptr), dim=1)


def train(args: argparse.Namespace) -> float:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = GAT(hidden=args.hidden, heads=args.heads)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    print(
        f"training a 2-layer GAT: {args.steps} steps, {args.graphs} graphs of "
        f"{args.min_nodes}..{args.max_nodes} nodes per batch"
    )
    losses: list[float] = []
    bar = tqdm(range(1, args.steps + 1), desc="  training", unit="step", dynamic_ncols=True)
    for step in bar:
        graphs = make_batch(gen, args.graphs, args.min_nodes, args.max_nodes)
        loss = F.cross_entropy(model(graphs), graphs.y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == args.steps:
            bar.set_postfix(loss=f"{statistics.fmean(losses[-10:]):.3f}")
    bar.close()
    with torch.no_grad():
        held_out = make_batch(gen, 256, args.min_nodes, args.max_nodes)
        accuracy = per_graph_accuracy(model(held_out), held_out)
    print(
        f"loss {statistics.fmean(losses[:10]):.3f} -> {statistics.fmean(losses[-10:]):.3f}; "
        f"held-out node accuracy {float(accuracy.mean()):.3f} (mean over 256 graphs, "
        f"worst graph {float(accuracy.min()):.2f})"
    )
    return float(accuracy.mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--graphs", type=int, default=32, help="graphs per batch")
    parser.add_argument("--min-nodes", type=int, default=4)
    parser.add_argument("--max-nodes", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    accuracy = train(args)
    if accuracy < args.min_accuracy:
        print(f"FAILED: accuracy {accuracy:.3f} is below {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
