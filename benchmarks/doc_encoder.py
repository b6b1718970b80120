"""A two-level document encoder on nested ragged values vs padding both levels.

Documents of sentences of tokens, ``(B, S*, L*, D)``. The encoder: a token MLP
(``linear`` + GELU), attention pooling of the tokens of every sentence (a score per
token, softmax over the sentence's tokens, weighted sum), layer norm and a linear
layer on the sentence vectors, attention pooling of the sentences of every document
(softmax over the document's sentences) and a loss on the document vectors.
Forward, and forward+backward (gradients of the token features and every parameter).

Systems, checked against ``padded`` before timing:

- ``raggedfn``: the nested value (``raggedfn.softmax(h, 2)``, ``raggedfn.sum(h, 2)``,
  then one level up ``softmax(s, 1)``, ``sum(s, 1)``): only real tokens and sentences.
- ``map``: the same encoder written per document, ``raggedfn.map(encode_document, x,
  p)``: raggedfn ops on the document (a one-level ``Ragged`` of sentences of tokens)
  and plain torch on its sentence vectors ``[S_i, D]``; ``map`` records it once on a
  stand-in document and runs the record on the whole nested batch.
- ``padded``: ``[B, S_max, L_max, D]`` with token and sentence masks (masked softmax
  at both levels): the work of every padded cell.
- ``loop``: document by document, sentence by sentence, with plain torch.

Lengths: sentences per document and tokens per sentence are lognormal (defaults:
B = 16 documents, mean 10 sentences in [1, 40], mean 20 tokens in [2, 96], D = 128),
fixed seeds; the ideal ratio is real tokens / padded token cells. One thread by
default; ratios are medians of per-round ratios, every system once per round in a
rotating order. Run: ``python -m benchmarks.doc_encoder [--docs 16] [--dim 128]
[--rounds 9] [--threads 1] [--json PATH] [--markdown PATH]``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import raggedfn
from benchmarks import plots
from benchmarks._standalone import cli, header, rotated_rounds, timed

Params = dict[str, Tensor]


def lognormal(count: int, mean: float, low: int, high: int, gen: torch.Generator) -> list[int]:
    sigma = 0.8
    mu = math.log(mean) - sigma**2 / 2
    raw = torch.exp(torch.randn(count, generator=gen, dtype=torch.float64) * sigma + mu)
    return raw.round().clamp(low, high).to(torch.int64).tolist()


def make_shape(docs: int, sentences: float, tokens: float, seed: int = 0) -> list[list[int]]:
    """Tokens per sentence of every document."""
    gen = torch.Generator().manual_seed(seed)
    counts = lognormal(docs, sentences, 1, 40, gen)
    shape = [lognormal(n, tokens, 2, 96, gen) for n in counts]
    return shape


def make_params(dim: int, seed: int = 1) -> Params:
    gen = torch.Generator().manual_seed(seed)

    def param(*size: int, scale: float = 1.0) -> Tensor:
        return (scale * torch.randn(*size, generator=gen)).requires_grad_(True)

    return {
        "w_token": param(dim, dim, scale=dim**-0.5),
        "b_token": param(dim, scale=0.1),
        "u_token": param(dim, scale=dim**-0.5),
        "w_sentence": param(dim, dim, scale=dim**-0.5),
        "u_sentence": param(dim, scale=dim**-0.5),
    }


def encode_ragged(x: raggedfn.Ragged, p: Params) -> Tensor:
    h = raggedfn.apply(F.gelu, raggedfn.linear(x, p["w_token"], p["b_token"]))  # (B, S*, L*, D)
    scores = raggedfn.softmax(raggedfn.linear(h, p["u_token"][None]), 2)  # over tokens
    sentences = raggedfn.sum(scores * h, 2)  # (B, S*, D)
    s = raggedfn.layer_norm(sentences, sentences.values.shape[-1])
    s = raggedfn.apply(torch.tanh, raggedfn.linear(s, p["w_sentence"]))
    weights = raggedfn.softmax(raggedfn.linear(s, p["u_sentence"][None]), 1)  # over sentences
    return raggedfn.sum(weights * s, 1)  # (B, D)


def encode_document(doc: raggedfn.Ragged, p: Params) -> Tensor:
    """One document ``(S, L*, D)``, for ``raggedfn.map``."""
    h = raggedfn.apply(F.gelu, raggedfn.linear(doc, p["w_token"], p["b_token"]))
    scores = raggedfn.softmax(raggedfn.linear(h, p["u_token"][None]), 1)  # over tokens
    sentences = raggedfn.sum(scores * h, 1)  # [S, D]
    s = torch.tanh(F.linear(F.layer_norm(sentences, sentences.shape[-1:]), p["w_sentence"]))
    weights = torch.softmax(s @ p["u_sentence"], 0)  # over the document's sentences
    return (weights.unsqueeze(-1) * s).sum(0)


def encode_map(x: raggedfn.Ragged, p: Params) -> Tensor:
    return raggedfn.map(encode_document, x, p, in_dims=(0, None))  # [B, D]


def _masked_softmax(scores: Tensor, mask: Tensor, dim: int) -> Tensor:
    scores = scores.masked_fill(~mask, float("-inf"))
    peak = scores.amax(dim, keepdim=True).clamp(min=-1e30)  # rows without any element: 0
    exp = torch.exp(scores - peak) * mask
    return exp / exp.sum(dim, keepdim=True).clamp(min=1e-30)


def encode_padded(x: Tensor, token_mask: Tensor, p: Params) -> Tensor:
    h = F.gelu(F.linear(x, p["w_token"], p["b_token"]))  # [B, S, L, D]
    scores = _masked_softmax(h @ p["u_token"], token_mask, 2)  # [B, S, L]
    sentences = (scores.unsqueeze(-1) * h).sum(2)  # [B, S, D]
    sentence_mask = token_mask.any(2)
    s = torch.tanh(F.linear(F.layer_norm(sentences, (x.shape[-1],)), p["w_sentence"]))
    weights = _masked_softmax(s @ p["u_sentence"], sentence_mask, 1)  # [B, S]
    return (weights.unsqueeze(-1) * s).sum(1)


def encode_loop(documents: list[list[Tensor]], p: Params) -> Tensor:
    out = []
    for sentences in documents:
        vectors = []
        for tokens in sentences:
            h = F.gelu(F.linear(tokens, p["w_token"], p["b_token"]))
            weight = torch.softmax(h @ p["u_token"], 0)
            vectors.append((weight.unsqueeze(-1) * h).sum(0))
        s = torch.stack(vectors)
        s = torch.tanh(F.linear(F.layer_norm(s, (s.shape[-1],)), p["w_sentence"]))
        weight = torch.softmax(s @ p["u_sentence"], 0)
        out.append((weight.unsqueeze(-1) * s).sum(0))
    return torch.stack(out)


def inputs(shape: list[list[int]], dim: int, seed: int = 2) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    documents = [[torch.randn(n, dim, generator=gen) for n in doc] for doc in shape]
    nested = raggedfn.from_list(documents)
    padded = raggedfn.to_padded(nested)
    mask = raggedfn.mask(nested)
    return {"documents": documents, "nested": nested, "padded": padded, "mask": mask}


def systems(data: dict[str, Any], p: Params) -> dict[str, Callable[[bool], Any]]:
    """Each system: ``fn(backward) -> document vectors`` or the gradients."""

    def graded(forward: Callable[[Tensor], Tensor], leaf: Tensor, backward: bool) -> Any:
        if not backward:
            with torch.no_grad():
                return forward(leaf)
        leaf = leaf.detach().requires_grad_(True)
        out = forward(leaf)
        grads = torch.autograd.grad(out.pow(2).sum(), [leaf, *p.values()])
        return grads[1:]  # parameter gradients (the input's are laid out differently)

    nested, padded, mask = data["nested"], data["padded"], data["mask"]
    documents = data["documents"]
    flat = torch.cat([t for doc in documents for t in doc])
    sizes = [[t.shape[0] for t in doc] for doc in documents]

    def split(values: Tensor) -> list[list[Tensor]]:
        out, start = [], 0
        for doc in sizes:
            row = []
            for n in doc:
                row.append(values[start : start + n])
                start += n
            out.append(row)
        return out

    return {
        "padded": lambda b: graded(lambda v: encode_padded(v, mask, p), padded, b),
        "raggedfn": lambda b: graded(
            lambda v: encode_ragged(nested.with_values(v), p), nested.values, b
        ),
        "map": lambda b: graded(lambda v: encode_map(nested.with_values(v), p), nested.values, b),
        "loop": lambda b: graded(lambda v: encode_loop(split(v), p), flat, b),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    shape = make_shape(args.docs, args.sentences, args.tokens)
    data = inputs(shape, args.dim)
    p = make_params(args.dim)
    fns = systems(data, p)
    real = sum(sum(doc) for doc in shape)
    s_max = max(len(doc) for doc in shape)
    l_max = max(max(doc) for doc in shape)
    record: dict[str, Any] = {
        **header("doc_encoder", args),
        "docs": args.docs,
        "dim": args.dim,
        "sentences": sum(len(doc) for doc in shape),
        "tokens": real,
        "padded_shape": [args.docs, s_max, l_max],
        "ideal_ratio": real / (args.docs * s_max * l_max),
        "rounds": args.rounds,
        "modes": {},
    }
    for mode, backward in (("fwd", False), ("fwd+bwd", True)):
        want = fns["padded"](backward)
        for name, fn in fns.items():  # agreement first
            got = fn(backward)
            pairs = zip(got, want, strict=True) if backward else [(got, want)]
            for g, w in pairs:
                torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-4, msg=f"{mode} {name}")
        runs = {name: timed(lambda fn=fn, bwd=backward: fn(bwd)) for name, fn in fns.items()}
        record["modes"][mode] = rotated_rounds(runs, args.rounds, also=("map",))
    return record


def markdown(record: dict[str, Any]) -> str:
    b, s, length = record["padded_shape"]
    lines = [
        f"Two-level document encoder, B = {b} documents, {record['sentences']} sentences, "
        f"{record['tokens']} tokens, D = {record['dim']}, padded [{b}, {s}, {length}, D] "
        f"(ideal ratio real / padded tokens {record['ideal_ratio']:.3f}), float32, "
        f"{record['threads']} thread(s), median of {record['rounds']} rounds",
        "",
        "| mode | raggedfn ms | map ms | padded ms | loop ms | raggedfn / padded | "
        "map / padded | map / raggedfn | raggedfn / loop |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, cells in record["modes"].items():
        ms, over = cells["median_ms"], cells["raggedfn_over"]
        by_map = cells.get("map_over", {})
        lines.append(
            f"| {mode} | {ms['raggedfn']:.1f} | {ms.get('map', float('nan')):.1f} | "
            f"{ms['padded']:.1f} | {ms['loop']:.1f} | {over['padded']:.3f} | "
            f"{by_map.get('padded', float('nan')):.3f} | "
            f"{by_map.get('raggedfn', float('nan')):.2f} | {over['loop']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--sentences", type=float, default=10.0, help="mean per document")
    parser.add_argument("--tokens", type=float, default=20.0, help="mean per sentence")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=9)
    return cli(parser, run, markdown, argv, plot=plots.plot_doc_encoder)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
