"""``ckpt-bench``: every checkpointing mode on the example models, side by side.

    ckpt-bench --out bench/                          # default sizes: minutes on 2 CPU cores
    ckpt-bench --quick --out /tmp/bench              # small models, under two minutes
    python -m ckpt_tools.bench --models gpt --modes none,hand,full,selective --out /tmp/b

Measured as ``DESIGN.md`` says, with the functions of :mod:`ckpt_plugin.measure`:
for each mode a fresh model (same seed, same batch) runs one warm-up step, then
one step under ``MemTracker`` (activation and total peak) and one under
``FlopCounterMode`` (FLOP ratio to ``none``). Step times come last, all modes of
a model in the same process, round-robin (the order rotates each round), each
mode at least ``--steps`` steps and ``--min-seconds`` per round, ``--repeats``
rounds. ``time_ratio`` is a ratio of medians; ``time_ratio_best``, of the
fastest steps, is less sensitive to other processes on a shared machine. A step
is forward, loss and backward (no optimiser: it is the same in every mode). The
bench runs on CPU, so ``offload`` has nothing to move here.

``hand`` is the baseline a user writes by hand: the model's ``forward`` calling
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` on every
block. ``full`` must cost the same FLOPs and total peak bytes; its one addition
is the BatchNorm fix's copy of one block's running statistics (pytorch#96136).

ResNet is checkpointed per ``Bottleneck``, not per ``ResStage``: with the default
depths there are 6 bottlenecks but only 3 stages, so ``every_n=2``, ``segments``,
``recursive`` and the auto planner get a chain long enough to differ, and a
bottleneck is the ResNet's counterpart of a ``TransformerBlock`` (the unit a user
would wrap by hand).

Writes ``results.json`` ({model: {mode: {peak_bytes, act_peak_bytes,
flops_ratio, time_ratio, ...}}}), ``results.md`` and ``plot.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ckpt_plugin.config.schema import MODES as CKPT_MODES
from ckpt_plugin.config.schema import AutoConfig, make_config
from ckpt_plugin.engine.offload import NOTHING_TO_MOVE
from ckpt_plugin.errors import closest_first
from ckpt_plugin.measure.memory import step_flops, step_memory
from ckpt_plugin.planning.rotor import describe
from ckpt_tools.compiled import PLUGIN_ROWS, measure_compiled_budget
from ckpt_tools.overhead import measure_overhead
from ckpt_tools.workloads import MODELS, MODES, ModelSpec, Run, build

__all__ = ["MODELS", "MODES", "ModelSpec", "Run", "build", "main", "pareto_front"]

MiB = 2**20
EXTRAS = ("overhead", "compiled")

def _is_auto(mode: str) -> bool:
    """Planned for a budget (ckpt=auto, segments=optimal): a budget it cannot meet is a result, not a crash."""
    keys = MODES[mode]
    return keys is not None and (isinstance(make_config(layers="-", **keys), AutoConfig) or "budget" in keys)


def measure_model(
    name: str, modes: list[str], args: argparse.Namespace, bar: tqdm
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Memory and FLOPs per mode (one step each), then interleaved step times; also the model's hparams."""
    spec = MODELS[name]
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    for mode in modes:
        bar.set_postfix_str(f"{name} {mode}: memory, FLOPs")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run = build(spec, mode, args.quick)
                run.step()  # warm-up: lazy initialisation (and auto's profiling of the first batch)
            except ValueError as err:
                if not _is_auto(mode):
                    raise
                # A budget the planner cannot meet is a result, not a crash: the row says so.
                rows[mode] = dict.fromkeys(("peak_bytes", "act_peak_bytes", "flops_ratio", "time_ratio")) | {
                    "error": str(err)
                }
                bar.update(1 + args.repeats)
                continue
            mem = step_memory(run.step, run.model)
            flops = step_flops(run.step)
        # Offload warns once per process that on CPU it has nothing to move; say it on every offload row.
        notes = [n for n in dict.fromkeys(str(w.message) for w in caught) if n != NOTHING_TO_MOVE]
        if mode == "offload":  # the bench runs on CPU
            notes.insert(0, "on CPU the saved activations already live in host memory: offload moves nothing here")
        runs[mode] = run
        rows[mode] = {"peak_bytes": mem["total"], "act_peak_bytes": mem["act"], "flops": flops,
                      "wrapped": run.wrapped, "notes": notes}
        if run.planned is not None:  # auto, optimal: what the planner predicted, and what planning cost
            rows[mode] |= {"predicted_peak_bytes": run.planned.predicted_peak,
                           "predicted_time_ratio": getattr(run.planned, "predicted_time_ratio", None),
                           "profile_peak_bytes": run.planning_peak_bytes,
                           "choices": getattr(run.planned, "choices", None) or describe(run.planned.schedule)}
        bar.update(1)
    seconds = time_steps(name, runs, args.repeats, args.steps, args.min_seconds, bar)
    base = rows["none"]
    for mode in runs:
        row = rows[mode]
        row["flops_ratio"] = row["flops"] / base["flops"]
        row["step_seconds"] = statistics.median(seconds[mode])
        row["time_ratio"] = row["step_seconds"] / statistics.median(seconds["none"])
        # Other processes only ever add time: on a shared machine the fastest steps compare more faithfully.
        row["time_ratio_best"] = min(seconds[mode]) / min(seconds["none"])
        row["act_fraction"] = row["act_peak_bytes"] / base["act_peak_bytes"]
        row["peak_fraction"] = row["peak_bytes"] / base["peak_bytes"]
        if "predicted_peak_bytes" in row:
            row["predicted_over_measured_peak"] = row["predicted_peak_bytes"] / row["act_peak_bytes"]
    return {mode: rows[mode] for mode in modes}, dict(runs["none"].model.hparams)


def time_steps(
    name: str, runs: dict[str, Run], repeats: int, steps: int, min_seconds: float, bar: tqdm
) -> dict[str, list[float]]:
    """Step times (seconds) per mode, modes interleaved round-robin in this process.

    Each visit runs at least ``steps`` steps and at least ``min_seconds``: short
    steps (the ResNet's) get many samples, so one burst of another process's
    work cannot decide a median.
    """
    modes = list(runs)
    times: dict[str, list[float]] = {m: [] for m in modes}
    bar.set_postfix_str(f"{name}: warm-up")
    for run in runs.values():  # warm again after the measuring dispatch modes
        run.step()
    gc.collect()
    gc.disable()  # as timeit does: a collection inside a timed step would land on one mode by chance
    try:
        for r in range(repeats):
            k = r % len(modes)  # rotate, so no mode always follows the same one
            for mode in modes[k:] + modes[:k]:
                bar.set_postfix_str(f"{name} {mode}: time, round {r + 1}/{repeats}")
                start = time.perf_counter()
                for n in itertools.count():
                    if n >= steps and time.perf_counter() - start >= min_seconds:
                        break
                    t0 = time.perf_counter()
                    runs[mode].step()
                    times[mode].append(time.perf_counter() - t0)
                bar.update(1)
    finally:
        gc.enable()
    return times


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the points no other point beats in both coordinates (lower is better), by x."""
    front, best_y = [], float("inf")
    for name, (_, y) in sorted(points.items(), key=lambda item: item[1]):
        if y < best_y:
            front.append(name)
            best_y = y
    return front


def write_plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """Activation peak against step time per model, labelled points, Pareto frontier drawn.

    The frontier is that of the fixed modes; auto's points, drawn apart, should lie on or beyond it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

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


def markdown(results: dict[str, dict[str, dict[str, Any]]], command: str, setup: dict[str, str],
             overhead: dict[str, Any] | None = None, compiled: dict[str, Any] | None = None) -> str:
    lines = ["# ckpt-bench results", "", "```bash", command, "```", ""]
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
    return "\n".join(lines)


def _choices(choices: dict[str, str] | str) -> str:
    """``full x10, keep x2`` for a plan's options (a schedule's nodes for segments=optimal)."""
    if isinstance(choices, str):
        return f"schedule {choices}"
    counts: dict[str, int] = {}
    for option in choices.values():
        counts[option] = counts.get(option, 0) + 1
    return ", ".join(f"{option} x{n}" for option, n in counts.items())


def command_line(argv: Sequence[str]) -> str:
    prog = Path(sys.argv[0]).name
    prog = "python -m ckpt_tools.bench" if prog in ("bench.py", "__main__.py", "-c", "") else prog
    return " ".join([prog, *map(shlex.quote, argv)])


def _parse_list(value: str, valid: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    for item in items:
        if item not in valid:
            parser.error(f"{flag}: {item!r} is not one of them; valid, closest first: "
                         f"{', '.join(closest_first(item, valid))}")
    if not items:
        parser.error(f"{flag} is empty; valid: {', '.join(valid)}")
    return list(dict.fromkeys(items))


def _mode_problems(modes: list[str]) -> list[str]:
    """Check every mode's keys before anything runs: a typo must not cost minutes."""
    problems = []
    for mode in modes:
        keys = MODES[mode]
        if keys is None:
            continue
        try:
            make_config(layers="Block", **keys)
        except ValueError as err:
            hint = ""
            if keys["mode"] not in CKPT_MODES:
                hint = f" (this ckpt_plugin has no mode {keys['mode']!r} yet: leave {mode} out of --modes)"
            problems.append(f"--modes {mode}: {err}{hint}")
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt-bench", description="Every activation-checkpointing mode on the example GPT and ResNet: "
        "activation and total peak memory, FLOP ratio and step-time ratio to no checkpointing."
    )
    parser.add_argument("--out", type=Path, default=Path("bench"),
                        help="directory for results.json, results.md, plot.png")
    parser.add_argument("--quick", action="store_true", help="small models and fewer timing rounds (under two minutes)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)} (none is always measured: the reference)")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds over all modes (default 5, --quick 3)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per mode per round, at least (default 2, --quick 3)")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="time per mode per round, at least (default 1.0, --quick 0.2)")
    parser.add_argument("--skip", default="",
                        help=f"comma-separated extras to leave out: {', '.join(EXTRAS)} (overhead: the plugin "
                        "over hand-written checkpoint on a tiny GPT; compiled: torch.compile with "
                        "activation_memory_budget=0.5 beside ckpt=auto 0.5, minutes)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 2)
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (0.2 if args.quick else 1.0)
    for flag in ("repeats", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)} must be >= 1")
    if args.min_seconds < 0:
        parser.error(f"--min-seconds={args.min_seconds} must be >= 0")
    models = _parse_list(args.models, list(MODELS), "--models", parser)
    modes = _parse_list(args.modes, list(MODES), "--modes", parser)
    if "none" not in modes:
        modes.insert(0, "none")  # every ratio is to it
    skipped = _parse_list(args.skip, EXTRAS, "--skip", parser) if args.skip.strip() else []
    problems = _mode_problems(modes)
    if importlib.util.find_spec("matplotlib") is None:  # found out now, not after minutes of measuring
        problems.append("plot.png needs matplotlib: pip install 'ckpt-plugin[bench]' (or pip install matplotlib)")
    if problems:
        parser.error("\n  ".join(["cannot run:", *problems]))

    command = command_line(argv)
    results, setup = {}, {}
    total = len(models) * len(modes) * (1 + args.repeats)
    with tqdm(total=total, desc="ckpt-bench", unit="run", file=sys.stderr) as bar:
        for name in models:
            spec = MODELS[name]
            results[name], hparams = measure_model(name, modes, args, bar)
            setup[name] = (f"{spec.plain.__name__}({', '.join(f'{k}={v}' for k, v in hparams.items())}); "
                           f"layers={spec.layers}; timing: {args.repeats} rounds, each mode at least "
                           f"{args.steps} steps and {args.min_seconds:g} s per round.")

    overhead = compiled = None
    if "overhead" not in skipped:
        print("ckpt-bench: overhead of the plugin over hand-written checkpoint (tiny GPT)", file=sys.stderr)
        overhead = measure_overhead(rounds=5 if args.quick else 15)
    if "compiled" not in skipped:
        print("ckpt-bench: torch.compile: torch's activation_memory_budget and the plugin's modes, compiled "
              f"({2 + len(PLUGIN_ROWS)} compiles: minutes)", file=sys.stderr)
        compiled = measure_compiled_budget(quick=args.quick, rounds=5, steps=1, plugin=list(PLUGIN_ROWS))
    args.out.mkdir(parents=True, exist_ok=True)
    extras = {k: v for k, v in (("overhead", overhead), ("compiled", compiled)) if v is not None}
    (args.out / "results.json").write_text(json.dumps(results | extras, indent=2, default=str) + "\n")
    table = markdown(results, command, setup, overhead, compiled)
    (args.out / "results.md").write_text(table)
    write_plot(results, args.out / "plot.png")
    print(table)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}, {args.out / 'plot.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
