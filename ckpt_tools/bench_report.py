"""What ``ckpt-bench`` writes: the tables (``results.md``), ``results.json`` and the Pareto plot (``plot.png``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from ckpt_tools.bench_fit import fit_table as _fit_table
from ckpt_plugin.config.schema import AutoConfig, make_config
from ckpt_tools.workloads import MODELS, MODES

MiB = 2**20


def _is_auto(mode: str) -> bool:
    """Planned for a budget (ckpt=auto, segments=optimal): a budget it cannot meet is a result, not a crash."""
    keys = MODES[mode]
    return keys is not None and (isinstance(make_config(layers="-", **keys), AutoConfig) or "budget" in keys)


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the points no other point beats in both coordinates (lower is better), by x."""
    front, best_y = [], float("inf")
    for name, (_, y) in sorted(points.items(), key=lambda item: item[1]):
        if y < best_y:
            front.append(name)
            best_y = y
    return front


def write_plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> str | None:
    """Activation peak against step time per model, labelled points, Pareto frontier drawn.

    The frontier is that of the fixed modes; auto's points, drawn apart, should lie on or beyond it.
    Returns why it drew nothing (matplotlib missing, no row timed), or None once ``path`` is written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # an optional dependency: the tables are the results, the plot a view of them
        return f"plot.png skipped: matplotlib cannot be imported ({err}); pip install 'ckpt-plugin[bench]'"
    results = {m: rows for m, rows in results.items() if any(r["time_ratio"] is not None for r in rows.values())}
    if not results:
        return "plot.png skipped: no mode has a step time"

    fig = Figure(figsize=(6 * len(results), 4.8))
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global backend
    for i, (model, rows) in enumerate(results.items()):
        ax = fig.add_subplot(1, len(results), i + 1)
        points = {m: (r["time_ratio"], r["act_fraction"]) for m, r in rows.items() if r["time_ratio"] is not None}
        front = pareto_front({m: p for m, p in points.items() if not _is_auto(m)})
        xs, ys = zip(*(points[m] for m in front), strict=True)
        ax.plot(xs, ys, drawstyle="steps-post", color="tab:blue", alpha=0.5, label="Pareto frontier (fixed modes)")
        xs_all, ys_all = zip(*points.values(), strict=True)
        span = (max(xs_all) - min(xs_all) or 1.0, max(ys_all) - min(ys_all) or 1.0)
        placed: list[tuple[float, float]] = []
        for mode, (x, y) in points.items():
            color = "tab:orange" if _is_auto(mode) else "tab:blue"
            filled = mode in front or _is_auto(mode)
            marker = "D" if _is_auto(mode) else "o"
            ax.scatter([x], [y], s=36, marker=marker, color=color if filled else "white", edgecolors=color, zorder=3)
            # Points that (nearly) coincide, like hand and full, get their labels stacked, not overprinted.
            near = sum(abs(x - px) / span[0] < 0.2 and abs(y - py) / span[1] < 0.04 for px, py in placed)
            placed.append((x, y))
            ax.annotate(mode, (x, y), xytext=(5, 3 - 10 * near), textcoords="offset points", fontsize=8)
        ax.set_xlabel("step time / none (median)")
        ax.set_ylabel("activation peak / none")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def markdown(results: dict[str, dict[str, dict[str, Any]]], command: str, setup: dict[str, str],
             overhead: dict[str, Any] | None = None, compiled: dict[str, Any] | None = None,
             device: str = "cpu", fit: dict[str, Any] | None = None) -> str:
    lines = ["# ckpt-bench results", "", "```bash", command, "```", ""]
    if torch.device(device).type == "cuda":
        lines += [f"torch {torch.__version__}, {torch.cuda.get_device_name(torch.device(device))}. "
                  "Peaks from torch.cuda.max_memory_allocated, FLOPs from FlopCounterMode (one step each); "
                  "time ratio: medians (and fastest) of interleaved steps in one process, each step synchronised.",
                  "",
                  "The total peak is the step's, as if its model were alone on the device (parameters and buffers "
                  "included). The act peak is what the forward leaves allocated on the device when the loss is "
                  "computed: the saved activations that stay there (`offload` moves them to pinned host memory).", ""]
    else:
        lines += [f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads. "
                  "Peaks from MemTracker, FLOPs from FlopCounterMode (one step each); "
                  "time ratio: medians (and fastest) of interleaved steps in one process.", "",
                  "Peaks are exact. The act peak is MemTracker's activation category, with every tensor a "
                  "recomputation makes counted as an activation (MemTracker alone counts it so only inside a "
                  "module whose own forward hooks run again, as in `hand`; see `_compat.CategoryPeakTracker`).", ""]
    for model, rows in results.items():
        lines += [f"## {model}", "", setup[model], ""]
        lines += ["| mode | act peak (MiB) | act / none | total peak (MiB) | total / none | FLOP ratio "
                  "| time ratio (median) | time ratio (best) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        notes = []
        for mode, r in rows.items():
            if r["time_ratio"] is None:
                lines.append(f"| {mode} | – | – | – | – | – | – | – |")
                notes.append(f"- {mode}: {r['error']}")
                continue
            lines.append(
                f"| {mode} | {r['act_peak_bytes'] / MiB:.1f} | {r['act_fraction']:.2f} "
                f"| {r['peak_bytes'] / MiB:.1f} | {r['peak_fraction']:.2f} "
                f"| {r['flops_ratio']:.3f} | {r['time_ratio']:.2f} | {r['time_ratio_best']:.2f} |"
            )
            notes += [f"- {mode}: {n}" for n in r["notes"]]
            if "predicted_peak_bytes" in r:
                ratio = r["predicted_time_ratio"]
                notes.append(
                    f"- {mode}: predicted act peak {r['predicted_peak_bytes'] / MiB:.1f} MiB "
                    f"({r['predicted_over_measured_peak']:.3f} of the measured), predicted time ratio "
                    + (f"{ratio:.2f}" if ratio is not None else "–")
                    + f" (measured {r['time_ratio']:.2f}); planning grew the process peak by "
                    + (f"{r['profile_peak_bytes'] / MiB:.1f} MiB" if r["profile_peak_bytes"] is not None else "–")
                    + f"; {_choices(r['choices'])}")
        lines += ["", *notes, ""] if notes else [""]
    if overhead is not None:
        lines += ["## overhead", "",
                  f"Plugin `ckpt=full` over hand-written `checkpoint(block, x, use_reentrant=False)` on the tiny "
                  f"{overhead['config']['model']}, {overhead['threads']} thread(s), "
                  f"{overhead['config']['rounds']} interleaved rounds of {overhead['config']['steps']} steps: "
                  f"plugin_over_hand {overhead['plugin_over_hand']:.3f} (medians), "
                  f"{overhead['plugin_over_hand_best']:.3f} (fastest steps), "
                  f"{overhead.get('plugin_over_hand_cpu', float('nan')):.3f} (CPU time).", ""]
    if compiled is not None:
        c = compiled
        lines += ["## torch.compile with activation_memory_budget", "",
                  f"GPT {c['model'] or '(default size)'}, backend {c['backend']}; saved bytes are what the "
                  "forward keeps for backward (each storage once, parameters excluded), the same measure for "
                  "every row.", "",
                  "| run | saved (MiB) | saved / its none | step time / its none |", "|---|---:|---:|---:|",
                  f"| compiled none | {c['compiled_none']['saved_bytes'] / MiB:.1f} | 1.00 | 1.00 |",
                  f"| compiled, activation_memory_budget={c['budget']:g} "
                  f"| {c['compiled_budget']['saved_bytes'] / MiB:.1f} | {c['act_fraction']:.2f} | {c['time_ratio']:.2f} |"]
        for name, row in c.get("plugin", {}).items():
            what = name.removeprefix("plugin_").replace("auto_", "ckpt=auto budget=")
            what = what if what.startswith("ckpt=") else f"ckpt={what}"
            if "error" in row:
                lines.append(f"| compiled + plugin {what} | refused: {row['error'].split(': the smallest ')[-1]} | | |")
                continue
            lines.append(f"| compiled + plugin {what} | {row['saved_bytes'] / MiB:.1f} | {row['act_fraction']:.2f} "
                         f"| {row['time_ratio']:.2f} |")
        if c.get("eager_auto"):
            lines += [f"| eager none | {c['eager_none']['saved_bytes'] / MiB:.1f} | 1.00 | 1.00 |",
                      f"| eager ckpt=auto budget={c['budget']:g} | {c['eager_auto']['saved_bytes'] / MiB:.1f} "
                      f"| {c['eager_act_fraction']:.2f} | {c['eager_time_ratio']:.2f} |"]
        lines.append("")
    if fit is not None:
        lines += _fit_table(fit)
    return "\n".join(lines)


def _choices(choices: dict[str, str] | str) -> str:
    """``full x10, keep x2`` for a plan's options (a schedule's nodes for segments=optimal)."""
    if isinstance(choices, str):
        return f"schedule {choices}"
    counts: dict[str, int] = {}
    for option in choices.values():
        counts[option] = counts.get(option, 0) + 1
    return ", ".join(f"{option} x{n}" for option, n in counts.items())


def write_results(out: Path, results: dict[str, Any], table: str) -> list[Path]:
    """``results.json``, ``results.md`` and, where matplotlib imports, ``plot.png`` into ``out``; what it wrote.

    A plot it cannot draw is one line on stderr saying why, never a failed run: the numbers are in the tables.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "results.md").write_text(table)
    written = [out / "results.json", out / "results.md"]
    skipped = write_plot({m: rows for m, rows in results.items() if m in MODELS}, out / "plot.png")
    if skipped is None:
        written.append(out / "plot.png")
    else:
        print(f"ckpt-bench: {skipped}", file=sys.stderr)
    return written


__all__ = ["markdown", "pareto_front", "write_plot", "write_results"]
