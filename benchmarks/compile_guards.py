"""How many guards dynamo installs for a compiled training step, with and without ``map``.

Issue #35's measurement. A small Hugging Face BERT (built from a config: ``--layers``
layers, hidden ``--hidden``, 4 heads, vocabulary 1024, dropout off, ``train()``,
SDPA attention) runs one training step: the forward and the loss (sum of squares of
the real tokens' last hidden states) under ``torch.compile(fullgraph=True)``, the
backward through the compiled graph's own backward. Systems:

- ``padded``: ``model(input_ids=ids, attention_mask=mask)`` on the right-padded batch;
- ``map``: ``raggedfn.map(lambda t: model(input_ids=t[None]).last_hidden_state[0],
  tokens)`` over the packed tokens (the model captured by the per-sample function);
- ``map functional``: ``raggedfn.map(one, tokens, params, in_dims=(0, None))`` where
  ``one`` calls ``torch.func.functional_call(model, params, ...)`` (the parameters
  passed as an argument).

Guards are counted from dynamo's own objects: the compiled frame's cache entries
(``torch._dynamo.eval_frame._debug_get_cache_entry_list(code)``), each entry's guard
manager tree walked node by node (``get_child_managers``, ``get_leaf_guards``,
``get_source``): ``guards`` is the number of leaf guards (each one check dynamo runs
per call), ``lines`` the number of lines of the printed tree (``str(guard_manager)``,
what ``TORCH_LOGS=guards`` prints), and ``by_root`` the leaf guards grouped by the
first step of their source (``L['model']``, ``G['raggedfn']``, a global's name...).
``check_us`` is the time of one evaluation of the guard tree on the call's frame
locals (median of repeats), ``step_ms`` the time of one compiled training step
(forward, loss and backward; median of ``--repeats`` rounds in which every system
runs once, in rotated order, after warm-up), ``--threads`` threads. Method: the
guard manager objects of dynamo's cache entry, not its logs.

Usage: ``python -m benchmarks.compile_guards [--layers 2] [--hidden 64] [--batch 8]
[--repeats 20] [--backend aot_eager] [--threads 1] [--json PATH [--markdown PATH]]``.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks import plots
from benchmarks._standalone import cli, header, rotated_rounds, timed

VOCAB = 1024


def make_model(layers: int, hidden: int) -> Any:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, intermediate_size=4 * hidden, max_position_embeddings=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).train()


def make_batch(batch: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """A right-padded ``(input_ids, attention_mask)``: lognormal lengths in [4, 64]."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(batch, generator=gen) * 0.6 + math.log(20))
    lengths = raw.round().clamp(4, 64).to(torch.int64)
    longest = int(lengths.max())
    mask = (torch.arange(longest) < lengths[:, None]).to(torch.int64)
    ids = torch.randint(1, VOCAB, (batch, longest), generator=gen) * mask
    return ids, mask


def systems(
    model: Any, ids: Tensor, mask: Tensor
) -> dict[str, tuple[Callable[..., Tensor], tuple]]:
    """Each system's loss function and its arguments (what ``torch.compile`` wraps)."""
    tokens = raggedfn.from_padded(ids, mask=mask)
    layout = tokens.layout
    params = dict(model.named_parameters())

    def padded(ids: Tensor, mask: Tensor) -> Tensor:
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        return out[mask.bool()].pow(2).sum()

    def mapped(values: Tensor, offsets: Tensor, sizes: Tensor) -> Tensor:
        x = raggedfn.Ragged(values, offsets, sizes, layout)
        out = raggedfn.map(lambda t: model(input_ids=t[None]).last_hidden_state[0], x)
        return out.values.pow(2).sum()

    def one(t: Tensor, p: dict[str, Tensor]) -> Tensor:
        return torch.func.functional_call(model, p, (t[None],)).last_hidden_state[0]

    def functional(values: Tensor, offsets: Tensor, sizes: Tensor, p: dict[str, Tensor]) -> Tensor:
        x = raggedfn.Ragged(values, offsets, sizes, layout)
        return raggedfn.map(one, x, p, in_dims=(0, None)).values.pow(2).sum()

    fields = (tokens.values, tokens.offsets, tokens.sizes)
    return {
        "padded": (padded, (ids, mask)),
        "map": (mapped, fields),
        "map functional": (functional, (*fields, params)),
    }


_ROOT = re.compile(r"^(?:L|G)\[['\"]([^'\"]+)['\"]\]|^(\w+)")


def _root(source: str) -> str:
    """The first step of a guard's source: ``L['model']`` of ``L['model']._modules[...]``."""
    while source.startswith(("___", "type(", "len(", "id(")) and "(" in source:
        source = source[source.index("(") + 1 :]
    match = _ROOT.match(source)
    if match is None:
        return source[:40] or "<root>"
    return match.group(0)


def guard_tree(entry: Any) -> dict[str, Any]:
    """Leaf guards of one cache entry, counted by walking its guard manager tree."""
    root = entry.guard_manager.root
    by_root: collections.Counter[str] = collections.Counter()
    by_kind: collections.Counter[str] = collections.Counter()
    by_source: collections.Counter[str] = collections.Counter()
    stack = [root]
    nodes = 0
    while stack:
        node = stack.pop()
        nodes += 1
        source = node.get_source()
        leaves = node.get_leaf_guards()
        for guard in leaves:
            by_kind[type(guard).__name__] += 1
        if leaves:
            by_root[_root(source)] += len(leaves)
            by_source[source] += len(leaves)
        stack.extend(node.get_child_managers())
    # relational guards and shape guards live on the root
    epilogue = (
        len(root.get_epilogue_lambda_guards()) if hasattr(root, "get_epilogue_lambda_guards") else 0
    )
    return {
        "guards": sum(by_kind.values()) + epilogue,
        "nodes": nodes,
        "lines": len(str(entry.guard_manager).splitlines()),
        "by_root": dict(by_root.most_common()),
        "by_kind": dict(by_kind.most_common()),
        "top_sources": dict(by_source.most_common(40)),
    }


def _frame_locals(fn: Callable[..., Any], args: tuple) -> dict[str, Any]:
    code = fn.__code__
    frame = dict(zip(code.co_varnames[: code.co_argcount], args, strict=True))
    cells = fn.__closure__ or ()
    frame.update({n: c.cell_contents for n, c in zip(code.co_freevars, cells, strict=True)})
    return frame


def measure(name: str, fn: Callable[..., Tensor], args: tuple, backend: str, repeats: int) -> Any:
    """Compile ``fn`` (first call: forward and backward), count its guards and time
    their evaluation; returns the row and the compiled function."""
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    start = time.perf_counter()
    compiled(*args).backward()
    compile_s = time.perf_counter() - start
    for _ in range(2):
        compiled(*args).backward()
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
    if len(entries) != 1:
        raise RuntimeError(f"{name}: {len(entries)} cache entries (recompiled)")
    tree = guard_tree(entries[0])
    frame = _frame_locals(fn, args)
    check = entries[0].guard_manager.check
    if not check(frame):
        raise RuntimeError(f"{name}: the guards fail on the call's own arguments")
    check_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            check(frame)
        check_s.append((time.perf_counter() - start) / 10)
    row = {**tree, "check_us": 1e6 * statistics.median(check_s), "compile_s": compile_s}
    return row, compiled


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = make_model(args.layers, args.hidden)
    ids, mask = make_batch(args.batch)
    chosen = systems(model, ids, mask)
    rows = {}
    steps = {}
    torch._dynamo.reset()
    for name in args.systems:
        fn, fn_args = chosen[name]
        fn(*fn_args).backward()  # eager once: map's trace of the per-sample function
        rows[name], compiled = measure(name, fn, fn_args, args.backend, args.repeats)
        steps[name] = timed(lambda c=compiled, a=fn_args: c(*a).backward())
        model.zero_grad(set_to_none=True)
    timing = rotated_rounds(steps, args.repeats, ours=args.systems[-1])
    for name in args.systems:
        rows[name]["step_ms"] = timing["median_ms"][name]
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(chosen[name][0].__code__)
        if len(entries) != 1:
            raise RuntimeError(f"{name}: recompiled while timing")
    record = {
        **header("compile_guards", args),
        "method": "leaf guards of the guard manager tree of the frame's one cache entry "
        "(torch._dynamo.eval_frame._debug_get_cache_entry_list); lines = str(guard_manager)",
        "config": {
            "layers": args.layers,
            "hidden": args.hidden,
            "batch": args.batch,
            "backend": args.backend,
            "repeats": args.repeats,
            "lengths": mask.sum(1).tolist(),
        },
        "rows": rows,
    }
    if "padded" in rows:
        record["added_over_padded"] = {
            name: r["guards"] - rows["padded"]["guards"]
            for name, r in rows.items()
            if name != "padded"
        }
    return record


def markdown(record: dict[str, Any]) -> str:
    c = record["config"]
    lines = [
        f"Guards of a compiled training step, HF BERT {c['layers']} layers hidden "
        f"{c['hidden']}, batch {c['batch']}, backend {c['backend']}, "
        f"{record['threads']} thread(s)",
        "",
        "| system | leaf guards | printed lines | guard check us | step ms | compile s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in record["rows"].items():
        lines.append(
            f"| {name} | {r['guards']} | {r['lines']} | {r['check_us']:.0f} "
            f"| {r['step_ms']:.2f} | {r['compile_s']:.1f} |"
        )
    for name, r in record["rows"].items():
        top = ", ".join(f"{k} {v}" for k, v in list(r["by_root"].items())[:8])
        lines.append(f"\n{name} by root: {top}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument(
        "--systems", nargs="+", default=["padded", "map", "map functional"],
        choices=["padded", "map", "map functional"],
    )  # fmt: skip
    return cli(parser, run, markdown, argv, plot=plots.plot_compile_guards)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
