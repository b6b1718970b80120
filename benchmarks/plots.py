"""Plots of the standalone benchmarks' records, and ``python -m benchmarks.plots``.

The harness suites (``benchmarks/results/*.json``) are plotted by
``harness.write_plot``; every other record (one folder per benchmark under
``benchmarks/results/``) is plotted here, by the benchmark's own run and again by
``python -m benchmarks.plots [--force]``, which writes the PNG of every committed
record that lacks one (``--force``: all of them). Each plot shows the ratios its
page's table discusses, with the target marked where the benchmark has one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

Groups = dict[str, dict[str, float]]


def write_bars(
    path: Path,
    title: str,
    groups: Groups,
    ylabel: str,
    *,
    target: float | Sequence[float] | None = None,
    log: bool = True,
) -> bool:
    """One group of bars per key of ``groups`` (one bar per series in it), a grey line
    at 1 and, given ``target`` (one or several), a red dotted line at each. False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = list(dict.fromkeys(s for bars in groups.values() for s in bars))
    if not series:
        return False
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 * len(groups) + 2), 3.4))
    for k, name in enumerate(series):
        xs = [i + k * width for i, bars in enumerate(groups.values()) if name in bars]
        ys = [bars[name] for bars in groups.values() if name in bars]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    for level in [] if target is None else [target] if isinstance(target, int | float) else target:
        ax.axhline(level, color="red", linestyle=":", label=f"target {level}x")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], list(groups), fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _modes_over(record: dict[str, Any], title: str, path: Path) -> bool:
    """Records with ``modes: {mode: {"raggedfn_over": {other: ratio}}}`` (moe, doc_encoder)."""
    groups = {
        mode: {f"over {other}": 1 / ratio for other, ratio in cell["raggedfn_over"].items()}
        for mode, cell in record["modes"].items()
    }
    return write_bars(path, title, groups, "raggedfn speedup (> 1: raggedfn faster)")


def plot_moe(record: dict[str, Any], path: Path) -> bool:
    return _modes_over(record, "Mixture-of-experts layer: raggedfn speedup", path)


def plot_doc_encoder(record: dict[str, Any], path: Path) -> bool:
    return _modes_over(record, "Two-level document encoder: raggedfn speedup", path)


def plot_forward_mode(record: dict[str, Any], path: Path) -> bool:
    groups = {
        transform: {"loop / raggedfn": 1 / ratio}
        for transform, ratio in record["raggedfn_over_loop"].items()
    }
    return write_bars(
        path, "torch.func transforms of an attention block", groups, "speedup over the loop"
    )


def plot_hf_bert(record: dict[str, Any], path: Path) -> bool:
    padded = record["median_ms"]["padded"]
    groups = {
        name: {"speedup over HF padded": padded / ms} for name, ms in record["median_ms"].items()
    }
    return write_bars(path, f"HF BERT ({record['hidden']} wide) through map", groups, "speedup")


def plot_hf_train(record: dict[str, Any], path: Path) -> bool:
    """Per family, map's speedup over HF padded and over HF packed (marked where the packed
    input mixes sequences), both targets marked."""
    groups = {
        family + ("" if cell["packed_keeps_sequences_apart"] else "\n(packed mixes)"): {
            "map over padded": cell["map_over_padded"],
            "map over packed": cell["map_over_packed"],
        }
        for family, cell in record["families"].items()
        if cell["status"] == "ok"
    }
    size = record["size"]
    return write_bars(
        path, f"HF training step (hidden {size['hidden']}, B {size['batch']}): map's speedup "
        f"(targets {record['targets']['map_over_padded']:g}x over padded, "
        f"{record['targets']['map_over_packed']:g}x over packed)",
        groups, "speedup (median of per-round ratios)",
        target=sorted(record["targets"].values()), log=False,
    )  # fmt: skip


def plot_overhead(record: dict[str, Any], path: Path) -> bool:
    groups = {
        f"{row['name']}\n/{row['other']}": {"raggedfn / other": row["ratio"]}
        for row in record["rows"]
        if row["name"] != "softmax_kernel"
    }
    return write_bars(path, "Per-call overhead (CPU time ratio, lower is better)", groups, "ratio")


def plot_pair_state(record: dict[str, Any], path: Path) -> bool:
    groups = {
        f"B {row['batch']} {row['mode']}": {
            f"loop / {name}": ratio for name, ratio in row["loop_over"].items() if name != "loop"
        }
        for row in record["rows"]
    }
    return write_bars(
        path, "Pair-state block: speedup over the per-sample loop", groups, "loop / system",
        target=1.2,
    )  # fmt: skip


def plot_map_bert(record: dict[str, Any], path: Path) -> bool:
    over = record["over"]["padded"]
    groups = {
        mode: {name: 1 / ratios[mode] for name, ratios in over.items() if name != "padded"}
        for mode in ("fwd", "fwd+bwd")
    }
    return write_bars(
        path, "map of a per-sample BERT layer: speedup over padded eager", groups, "speedup",
        target=2.0, log=False,
    )  # fmt: skip


def plot_map_retrace(record: dict[str, Any], path: Path) -> bool:
    groups = {
        name.split(",")[0].split(" (")[0]: {"rebound / fixed": row["ratio"]}
        for name, row in record["rows"].items()
    }
    return write_bars(
        path, "Training loops rebinding their weights (lower is better)", groups,
        "time per step, rebound / fixed", target=1.2, log=False,
    )  # fmt: skip


def plot_one_row(record: dict[str, Any], path: Path) -> bool:
    groups = {"HF BERT step": {"with one-row samples / without": record["one_row_over_normal"]}}
    return write_bars(
        path, "Batches with samples of one row through map (lower is better)", groups,
        "time per step, ratio", target=1.2, log=False,
    )  # fmt: skip


def plot_compile_guards(record: dict[str, Any], path: Path) -> bool:
    groups = {name: {"leaf guards": row["guards"]} for name, row in record["rows"].items()}
    return write_bars(
        path, "Guards dynamo installs per compiled HF BERT step (lower is better)", groups,
        "leaf guards", target=1000, log=False,
    )  # fmt: skip


def plot_bert_full(record: dict[str, Any], path: Path) -> bool:
    kind = "compiled" if record["compiled"] else "eager"
    groups = {
        scale: {"ideal": cell["ideal_speedup"], f"raggedfn {kind}": cell["speedup"]}
        for scale, cell in record["scales"].items()
    }
    return write_bars(
        path, f"BERT at the issue's lengths, {kind} fwd+bwd: speedup over padded", groups,
        "speedup", target=3.39 if record["compiled"] else 2.74, log=False,
    )  # fmt: skip


def plot_compiled_layer(record: dict[str, Any], path: Path) -> bool:
    groups = {
        system: {
            "median of per-round ratios": ratios["median_of_ratios"],
            "ratio of minima": ratios["ratio_of_minima"],
        }
        for system, ratios in record["compiled_over_eager"].items()
    }
    return write_bars(
        path, f"One BERT layer ({record['scale']}), fwd+bwd: compiled over eager", groups,
        "speedup of compile", target=1.3, log=False,
    )  # fmt: skip


def plot_distributed(record: dict[str, Any], path: Path) -> bool:
    from benchmarks import distributed

    return distributed.write_plot(record, path)


def plot_fsdp_ddp(record: dict[str, Any], path: Path) -> bool:
    """FSDP2 over DDP: per-rank state (parameters + gradients + Adam), peak RSS and step
    time, both targets marked."""
    groups = {
        "state per rank\n(params+grads+Adam)": {"fsdp / ddp": record["state_ratio"]},
        "peak RSS per rank": {"fsdp / ddp": record["peak_rss_ratio"]},
        "step time": {"fsdp / ddp": record["time_ratio"]},
    }
    if record.get("plain_time_ratio") is not None:  # FSDP2's own ratio, without map
        groups["step time without map\n(reference)"] = {"fsdp / ddp": record["plain_time_ratio"]}
    groups = {k: v for k, v in groups.items() if v["fsdp / ddp"] is not None}
    size = record["size"]
    return write_bars(
        path, f"FSDP2 (every block sharded, in map) / DDP: {record['world']} ranks, "
        f"{size['blocks']} x {size['hidden']} wide, B {size['batch']} per rank",
        groups, "FSDP2 / DDP", target=sorted(record["targets"].values()), log=False,
    )  # fmt: skip


def plot_harness(record: dict[str, Any], path: Path) -> bool:
    from benchmarks.harness import write_plot

    return write_plot(record, path)


# record stem (without -quick/-cpu/... tails) -> plotter
PLOTTERS: dict[str, Callable[[dict[str, Any], Path], bool]] = {
    "moe": plot_moe,
    "doc_encoder": plot_doc_encoder,
    "forward_mode": plot_forward_mode,
    "hf_bert": plot_hf_bert,
    "hf_train": plot_hf_train,
    "overhead": plot_overhead,
    "pair_state": plot_pair_state,
    "distributed": plot_distributed,
    "map_bert": plot_map_bert,
    "map_retrace": plot_map_retrace,
    "one_row": plot_one_row,
    "compile_guards": plot_compile_guards,
    "bert_full": plot_bert_full,
    "compiled_layer": plot_compiled_layer,
    "fsdp_ddp": plot_fsdp_ddp,
}


def plotter_for(
    path: Path, results: Path = RESULTS
) -> Callable[[dict[str, Any], Path], bool] | None:
    """How the record at ``path`` is plotted: harness records (top level of
    ``results``) by ``harness.write_plot``, others by the plotter of their name (without
    ``-quick``-style tails) or of their folder."""
    if path.parent == results:
        return plot_harness
    return PLOTTERS.get(path.stem.split("-")[0]) or PLOTTERS.get(path.parent.name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__)
    parser.add_argument("--force", action="store_true", help="rewrite existing plots too")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for record_path in sorted(args.results.rglob("*.json")):
        png = record_path.with_suffix(".png")
        plot = plotter_for(record_path, args.results)
        if plot is None or (png.exists() and not args.force):
            continue
        ok = plot(json.loads(record_path.read_text()), png)
        print(f"{png}: {'written' if ok else 'not written (matplotlib missing?)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
