"""A Hugging Face BERT-base-sized encoder: ``raggedfn.map`` vs HF padded vs HF packed.

The model is ``transformers.BertModel`` built from a config with BERT-base's width
(hidden 768, 12 heads, intermediate 3072; ``--layers`` of them, 2 by default to keep
the run short on a CPU), SDPA attention, float32, random weights. One batch of
lognormal lengths clipped to ``[8, --max-len]`` with one sample at the maximum, so
the padded batch is about 25% real tokens. Forward+backward: the loss is a fixed
random projection of the real tokens' last hidden states; gradients reach every
parameter (``loss.backward()``).

Systems, each checked against ``padded`` before timing:

- ``padded``: HF's own batched call, ``model(input_ids, attention_mask)``.
- ``map``: the unchanged model on one sequence, ``model(input_ids=ids[None])``, run
  by ``raggedfn.map`` over ``from_padded(input_ids, mask=attention_mask)``.
- ``map+ids``: the same with ``position_ids`` and ``token_type_ids`` passed in
  (``raggedfn.positions``, zeros), which avoids the position-buffer slice and the
  token-type gather of the plain call (the record's ``map_fallback`` lists what, if
  anything, still runs per sample).
- with ``--compiled`` (default), each of them also under
  ``torch.compile(fullgraph=True)`` (inductor, static shapes: one batch): ``padded
  compiled`` compiles HF's batched call, ``map compiled`` / ``map+ids compiled`` a
  function of the packed ids (``values``, ``offsets``, ``sizes``) and the parameters
  that calls ``raggedfn.map``; the backward runs through the compiled graph's own
  backward. The first call's seconds (dynamo + AOTAutograd + inductor, forward
  and backward) are recorded as ``compile_seconds``.
- HF's padding-free path (``DataCollatorWithFlattening`` + packed ``position_ids``)
  is checked but not timed: up to transformers 5.24 only ``create_causal_mask``
  (decoders) reads packed ``position_ids``; BERT's bidirectional mask ignores them,
  so with SDPA on a CPU the packed sequences attend to each other (the
  flash-attention path that uses ``cu_seq_lens`` needs CUDA). Since 5.25
  ``create_bidirectional_mask`` reads them too and the packed path agrees with
  ``padded`` (a ``[1, 1, T, T]`` mask over the whole packed batch).

Each round runs every system once, back to back, in this process; the speedup is
the median of the per-round ratios to ``padded``. One thread by default.

Run: ``python -m benchmarks.hf_bert [--layers 2] [--batch 8] [--max-len 256]
[--rounds 5] [--threads 1] [--no-compiled] [--compile map+ids ...]``; prints a markdown table (and ``--json
PATH`` writes the record).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks import plots

VOCAB = 30522


def make_model(layers: int, hidden: int = 768, heads: int = 12) -> Any:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).train()


def make_lengths(batch: int, max_len: int, seed: int = 0) -> Tensor:
    """Lognormal lengths (median max_len / 6) clipped to [8, max_len], one at max_len."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(batch, generator=gen) * 0.6 + math.log(max_len / 6))
    lengths = raw.round().clamp(8, max_len).to(torch.int64)
    lengths[0] = max_len
    return lengths


def make_batch(lengths: Tensor, seed: int = 1) -> tuple[Tensor, Tensor]:
    """A right-padded ``(input_ids, attention_mask)`` pair, as a tokenizer returns it."""
    gen = torch.Generator().manual_seed(seed)
    longest = int(lengths.max())
    mask = (torch.arange(longest) < lengths[:, None]).to(torch.int64)
    ids = torch.randint(1000, VOCAB, (lengths.shape[0], longest), generator=gen) * mask
    return ids, mask


def systems(model: Any, ids: Tensor, mask: Tensor) -> dict[str, Callable[[], Tensor]]:
    """Each system's last hidden states of the real tokens, ``[T, hidden]``."""
    params = dict(model.named_parameters())
    tokens = raggedfn.from_padded(ids, mask=mask)
    positions = raggedfn.positions(tokens)

    def one(t: Tensor, p: dict[str, Tensor]) -> Tensor:
        return torch.func.functional_call(model, p, (t[None],)).last_hidden_state[0]

    def one_with_ids(t: Tensor, pos: Tensor, p: dict[str, Tensor]) -> Tensor:
        kwargs = {"position_ids": pos[None], "token_type_ids": torch.zeros_like(t)[None]}
        return torch.func.functional_call(model, p, (t[None],), kwargs).last_hidden_state[0]

    def padded() -> Tensor:
        return model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]

    def mapped() -> Tensor:
        return raggedfn.map(one, tokens, params, in_dims=(0, None)).values

    def mapped_ids() -> Tensor:
        out = raggedfn.map(one_with_ids, tokens, positions, params, in_dims=(0, 0, None))
        return out.values

    return {"padded": padded, "map": mapped, "map+ids": mapped_ids}


COMPILED = ("padded", "map", "map+ids")


def compiled_systems(
    model: Any, ids: Tensor, mask: Tensor, backend: str = "inductor"
) -> dict[str, Callable[[], Tensor]]:
    """The same systems under ``torch.compile(fullgraph=True)`` (inductor by default)."""
    params = dict(model.named_parameters())
    tokens = raggedfn.from_padded(ids, mask=mask)
    layout = tokens.layout

    def one(t: Tensor, p: dict[str, Tensor]) -> Tensor:
        return torch.func.functional_call(model, p, (t[None],)).last_hidden_state[0]

    def one_with_ids(t: Tensor, pos: Tensor, p: dict[str, Tensor]) -> Tensor:
        kwargs = {"position_ids": pos[None], "token_type_ids": torch.zeros_like(t)[None]}
        return torch.func.functional_call(model, p, (t[None],), kwargs).last_hidden_state[0]

    def padded(ids: Tensor, mask: Tensor) -> Tensor:
        return model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]

    def mapped(values: Tensor, offsets: Tensor, sizes: Tensor, p: dict[str, Tensor]) -> Tensor:
        x = raggedfn.Ragged(values, offsets, sizes, layout)
        return raggedfn.map(one, x, p, in_dims=(0, None)).values

    def mapped_ids(values: Tensor, offsets: Tensor, sizes: Tensor, p: dict[str, Tensor]) -> Tensor:
        x = raggedfn.Ragged(values, offsets, sizes, layout)
        pos = raggedfn.positions(x)
        return raggedfn.map(one_with_ids, x, pos, p, in_dims=(0, 0, None)).values

    fields = (tokens.values, tokens.offsets, tokens.sizes)
    padded_c = torch.compile(padded, fullgraph=True, backend=backend)
    mapped_c = torch.compile(mapped, fullgraph=True, backend=backend)
    mapped_ids_c = torch.compile(mapped_ids, fullgraph=True, backend=backend)
    return {
        "padded compiled": lambda: padded_c(ids, mask),
        "map compiled": lambda: mapped_c(*fields, params),
        "map+ids compiled": lambda: mapped_ids_c(*fields, params),
    }


def hf_packed_error(model: Any, ids: Tensor, mask: Tensor) -> float:
    """Largest difference of HF's padding-free path (flattening collator) to ``padded``."""
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask, strict=True)]
    packed = DataCollatorWithFlattening(return_tensors="pt")(features)
    with torch.no_grad():
        out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"])
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
    return float((out.last_hidden_state[0] - want).abs().max())


def check_agreement(fns: dict[str, Callable[[], Tensor]], tolerance: float = 1e-4) -> None:
    """Every system's hidden states equal ``padded``'s (never time a wrong computation)."""
    with torch.no_grad():
        want = fns["padded"]()
        for name, fn in fns.items():
            got = fn()
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance, msg=name)


def step(model: Any, fn: Callable[[], Tensor], cotangent: Tensor) -> float:
    """Seconds of one forward+backward (gradients of every parameter)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    (fn() * cotangent).sum().backward()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    lengths = make_lengths(args.batch, args.max_len)
    ids, mask = make_batch(lengths)
    model = make_model(args.layers, args.hidden, args.heads)
    fns = systems(model, ids, mask)
    compile_seconds: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # map's per-sample fallback warns once
        check_agreement(fns)  # (and traces map's per-sample functions eagerly)
        if args.compiled:
            torch._dynamo.reset()
            compiled = {
                name: fn
                for name, fn in compiled_systems(model, ids, mask, args.backend).items()
                if name.removesuffix(" compiled") in args.compile
            }
            cotangent = torch.randn(int(lengths.sum()), model.config.hidden_size)
            for name, fn in compiled.items():  # first call: compile forward and backward
                compile_seconds[name] = step(model, fn, cotangent)
            check_agreement({"padded": fns["padded"], **compiled})
            fns.update(compiled)
        report = raggedfn.map_report(
            lambda t, p: torch.func.functional_call(model, p, (t[None],)).last_hidden_state[0],
            raggedfn.from_padded(ids, mask=mask),
            dict(model.named_parameters()),
            in_dims=(0, None),
        )
        tokens = raggedfn.from_padded(ids, mask=mask)
        report_ids = raggedfn.map_report(
            lambda t, pos, p: torch.func.functional_call(
                model, p, (t[None],), {"position_ids": pos[None], "token_type_ids": 0 * t[None]}
            ).last_hidden_state[0],
            tokens,
            raggedfn.positions(tokens),
            dict(model.named_parameters()),
            in_dims=(0, 0, None),
        )
        packed_error = hf_packed_error(model, ids, mask)
        cotangent = torch.randn(int(lengths.sum()), model.config.hidden_size)
        for fn in fns.values():  # warm-up (and map's trace)
            step(model, fn, cotangent)
        times: dict[str, list[float]] = {name: [] for name in fns}
        ratios: dict[str, list[float]] = {name: [] for name in fns}
        eager_ratios: dict[str, list[float]] = {n: [] for n in fns if n.endswith(" compiled")}
        for _ in range(args.rounds):
            row = {name: step(model, fn, cotangent) for name, fn in fns.items()}
            for name, seconds in row.items():
                times[name].append(seconds)
                ratios[name].append(row["padded"] / seconds)
                if name.endswith(" compiled"):
                    eager_ratios[name].append(row[name[: -len(" compiled")]] / seconds)
    occupancy = float(lengths.sum()) / (args.batch * int(lengths.max()))
    pairs = float((lengths.double() ** 2).sum()) / (args.batch * int(lengths.max()) ** 2)
    return {
        "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.hf_bert " + " ".join(args.argv),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": args.threads,
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "batch": args.batch,
        "lengths": lengths.tolist(),
        "occupancy_tokens": occupancy,
        "occupancy_pairs": pairs,
        "rounds": args.rounds,
        "map_fallback": sorted(report.fallback),
        "map_ids_fallback": sorted(report_ids.fallback),
        "hf_packed_max_error": packed_error,
        "compile_seconds": compile_seconds,
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "speedup": {name: statistics.median(r) for name, r in ratios.items()},
        # each compiled system over the same system eager (median of per-round ratios)
        "compiled_over_eager": {n: statistics.median(r) for n, r in eager_ratios.items()},
    }


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"BertModel, width {record['hidden']}/{record['heads']}/{4 * record['hidden']}, "
        f"{record['layers']} layers, SDPA, float32, "
        f"B = {record['batch']}, lengths {record['lengths']} (occupancy "
        f"{record['occupancy_tokens']:.2f} of tokens, {record['occupancy_pairs']:.2f} of "
        f"attention pairs), forward+backward, {record['threads']} thread(s), median of "
        f"{record['rounds']} rounds",
        "",
        "| system | ms | speedup over padded (median of per-round ratios) |",
        "|---|---|---|",
    ]
    for name, ms in record["median_ms"].items():
        lines.append(f"| {name} | {ms:.0f} | {record['speedup'][name]:.2f}x |")
    if record.get("compiled_over_eager"):
        over = ", ".join(f"{k} {v:.2f}x" for k, v in record["compiled_over_eager"].items())
        lines += ["", f"compiled over the same system eager: {over}"]
    if record.get("compile_seconds"):
        first = ", ".join(f"{k} {v:.0f} s" for k, v in record["compile_seconds"].items())
        lines += ["", f"first call (compile, forward and backward): {first}"]
    lines += [
        "",
        f"ideal (real / padded tokens): {1 / record['occupancy_tokens']:.2f}x for the "
        f"token-wise layers, {1 / record['occupancy_pairs']:.2f}x for attention; map ran "
        f"per sample: {', '.join(record['map_fallback']) or 'nothing'} (map+ids: "
        f"{', '.join(record['map_ids_fallback']) or 'nothing'}); HF's packed path "
        f"(DataCollatorWithFlattening) differs from padded by "
        f"{record['hf_packed_max_error']:.2g} (not timed)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768, help="BERT-base: 768")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each system under torch.compile(fullgraph=True)",
    )
    parser.add_argument(
        "--compile",
        nargs="+",
        default=list(COMPILED),
        choices=COMPILED,
        help="which systems --compiled compiles (one alone, in its own process with an "
        "empty TORCHINDUCTOR_CACHE_DIR, for a cold first compile)",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else []
    record = run(args)
    print(markdown(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        plots.plot_hf_bert(record, Path(args.json).with_suffix(".png"))
    return record


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
