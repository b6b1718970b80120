"""Records and reports: the JSON record, markdown tables and plots of a suite run."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ._cases import BASELINE


def write_json(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")


def baseline_of(record: dict[str, Any]) -> str:
    """The system a record's ratios are relative to (``padded`` in older records)."""
    return str(record.get("baseline", BASELINE))


def _fmt_time(cell: dict[str, Any], baseline: str) -> str:
    if cell["status"] != "ok":
        return cell["status"].split(":", 1)[0]  # missing / fails / wrong (details below)
    if cell["system"] == baseline:
        return f"{cell['time_ms']:.2f}"
    return f"{cell['time_ms']:.2f} ({cell['ratio']:.2f}x)"


def markdown_table(record: dict[str, Any]) -> str:
    """The results as markdown: one table per distribution, one row per workload and mode.

    Each system column shows the median time in ms and, in brackets, its ratio to
    the padded time in the same rounds (lower is better). ``ideal`` is the ratio
    that saving all padding would give; ``of ideal`` is ideal / the primary
    system's ratio. Memory columns give the peak MiB each system's step added.
    """
    systems: list[str] = record["systems"]
    primary = record["primary"]
    baseline = baseline_of(record)
    cells = record["cells"]
    lines: list[str] = []
    notes: dict[str, str] = {}
    for dist, info in record["distributions"].items():
        lines.append(
            f"**{dist}** ({info['note']}; B = {len(info['lengths'])}, "
            f"mean length {sum(info['lengths']) / max(len(info['lengths']), 1):.1f}, "
            f"max {max(info['lengths'], default=0)}, occupancy {info['occupancy']:.3f}, "
            f"seed {info['seed']})"
        )
        lines.append("")
        header = ["op", "mode", *(f"{s} ms" for s in systems), "ideal", f"{primary} of ideal"]
        has_memory = any(c["peak_memory_mb"] is not None for c in cells)
        if has_memory:
            header += [f"{s} MiB" for s in systems]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        rows = dict.fromkeys((c["workload"], c["mode"]) for c in cells if c["distribution"] == dist)
        for workload, mode in rows:
            by_system = {
                c["system"]: c
                for c in cells
                if c["distribution"] == dist and c["workload"] == workload and c["mode"] == mode
            }
            row = [workload, mode]
            for s in systems:
                cell = by_system.get(s)
                row.append(_fmt_time(cell, baseline) if cell else "")
                if cell and cell["status"] != "ok":
                    notes.setdefault(f"{s} {workload} {mode}", cell["status"])
            first = next(iter(by_system.values()))
            row.append(f"{first['ideal_ratio']:.3f}")
            main = by_system.get(primary)
            row.append(
                f"{main['fraction_of_ideal']:.2f}"
                if main and main["fraction_of_ideal"] is not None
                else ""
            )
            if has_memory:
                for s in systems:
                    cell = by_system.get(s)
                    mem = cell["peak_memory_mb"] if cell else None
                    row.append(f"{mem:.1f}" if mem is not None else "")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.extend(versus_table(record, dist))
    lines.extend(summary_lines(record))
    if notes:
        lines.append("Cells that did not run:")
        lines.append("")
        for where, status in notes.items():
            lines.append(f"- {where}: {status}")
        lines.append("")
    return "\n".join(lines)


def versus_table(record: dict[str, Any], dist: str) -> list[str]:
    """The primary system's speedup over every other system, from the same rounds.

    ``other / primary`` as the median of per-round ratios (above 1: the primary
    system is faster). Empty for records without per-round comparisons.
    """
    primary = record["primary"]
    mine = [
        c
        for c in record["cells"]
        if c["distribution"] == dist and c["system"] == primary and c.get("versus")
    ]
    others = [s for s in record["systems"] if s not in (primary, baseline_of(record))]
    others = [s for s in others if any(s in c["versus"] for c in mine)]
    if not mine or not others:
        return []
    header = ["op", "mode", *(f"{primary} vs {s}" for s in others)]
    lines = [
        f"{primary}'s speedup over each system (median of per-round ratios, above 1 = "
        f"{primary} faster):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for c in mine:
        row = [c["workload"], c["mode"]]
        row += [f"{1 / c['versus'][s]:.2f}x" if s in c["versus"] else "" for s in others]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


def summary_lines(record: dict[str, Any]) -> list[str]:
    """Geometric-mean speedup over the baseline across a suite's workloads, and compile facts.

    One line per (distribution, mode, system) with every workload measured
    (``ok``); compiled systems' compile time (first call minus second, s) and
    graphs compiled are listed per cell where the builder recorded them.
    """
    cells = record["cells"]
    baseline = baseline_of(record)
    lines: list[str] = []
    groups = dict.fromkeys(
        (c["distribution"], c["mode"], c["system"]) for c in cells if c["system"] != baseline
    )
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    for dist, mode, system in groups:
        got = [
            c
            for c in cells
            if (c["distribution"], c["mode"], c["system"]) == (dist, mode, system)
            and c["status"] == "ok"
        ]
        if len(workloads) < 2 or len(got) != len(workloads):
            continue
        speedup = math.exp(statistics.fmean(-math.log(c["ratio"]) for c in got))
        ideal = math.exp(statistics.fmean(-math.log(c["ideal_ratio"]) for c in got))
        lines.append(
            f"- {dist}, {mode}, {system}: geometric-mean speedup over {baseline} "
            f"{speedup:.2f}x across {', '.join(workloads)} (ideal {ideal:.2f}x)"
        )
    if lines:
        lines = ["Summary:", "", *lines, ""]
    compiled = [c for c in cells if "compile_s" in c.get("extra", {})]
    if compiled:
        lines += ["Compile time (first call minus second, s) / graphs compiled:", ""]
        lines += [
            f"- {c['workload']} {c['mode']} {c['distribution']} {c['system']}: "
            f"{c['extra']['compile_s']} s / {c['extra'].get('graphs', '?')} graphs"
            for c in compiled
        ]
        lines.append("")
    return lines


def markdown_report(record: dict[str, Any]) -> str:
    """A heading, the run's settings and :func:`markdown_table`."""
    m = record["machine"]
    head = [
        f"### {record['suite']} ({'quick' if record['quick'] else 'full'}, {record['device']})",
        "",
        f"`{record['command']}` on {m['cpu']} ({m['nproc']} CPUs), torch {record['torch']}, "
        f"{record['threads']} threads, {record['warmup']} warm-up runs, median of "
        f"{record['repeats']} rounds (at least 3, fewer where a system used up its "
        f"{record.get('max_seconds', '?')} s budget){_interleaving(record)}, {record['created']}.",
        "",
    ]
    return "\n".join(head) + markdown_table(record)


def _interleaving(record: dict[str, Any]) -> str:
    if record.get("interleaved"):
        return "; every system timed once per round, in rotated order"
    return ""


def write_markdown(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_report(record))


def write_plot(record: dict[str, Any], path: Path) -> bool:
    """Speedup over the baseline per workload and distribution, ideal marked (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    baseline = baseline_of(record)
    cells = [c for c in record["cells"] if c["status"] == "ok" and c["system"] != baseline]
    rows = list(dict.fromkeys((c["distribution"], c["mode"]) for c in cells))
    if not rows:
        return False
    systems = [s for s in record["systems"] if s != baseline]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.6 * len(rows)), squeeze=False)
    for ax, (dist, mode) in zip(axes[:, 0], rows, strict=True):
        workloads = list(dict.fromkeys(c["workload"] for c in cells if c["distribution"] == dist))
        width = 0.8 / max(len(systems), 1)
        for k, system in enumerate(systems):
            heights = []
            for w in workloads:
                match = [
                    c
                    for c in cells
                    if (c["distribution"], c["mode"], c["workload"], c["system"])
                    == (dist, mode, w, system)
                ]
                heights.append(1 / match[0]["ratio"] if match else 0)
            ax.bar([i + k * width for i in range(len(workloads))], heights, width, label=system)
        ideal = [
            1
            / next(c for c in cells if c["distribution"] == dist and c["workload"] == w)[
                "ideal_ratio"
            ]
            for w in workloads
        ]
        ax.scatter(
            [i + 0.4 - width / 2 for i in range(len(workloads))],
            ideal,
            marker="_",
            s=400,
            color="black",
            label="ideal",
            zorder=3,
        )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        ax.set_ylabel(f"speedup vs {baseline}")
        ax.set_yscale("log")
        ax.set_title(f"{record['suite']}: {dist}, {mode}")
        ax.legend(fontsize=7, ncol=len(systems) + 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
