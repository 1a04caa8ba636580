"""``ckpt-bench``: every checkpointing mode on the example models, side by side.

    ckpt-bench --out bench/                          # default sizes: minutes on 2 CPU cores
    ckpt-bench --quick --out /tmp/bench              # small models, 8 modes, no compile: under two minutes
    python -m ckpt_tools.bench --models gpt --modes none,hand,full,selective --out /tmp/b
    ckpt-bench --quick --modes none --fit 0.5 --out /tmp/fit    # + ckpt.memory with ckpt.batch=max, timed
    python -m ckpt_tools.bench --device cuda --precision bf16-mixed --models gpt \
        --gpt n_layer=16,n_embd=2048,n_head=16,block_size=1024,batch_size=16 \
        --modes none,full,selective,offload --skip overhead,compiled --keep-going --out /tmp/g

Measured as ``DESIGN.md`` says, with the functions of :mod:`ckpt_plugin.measure`:
for each mode a fresh model (same seed, same batch) runs one warm-up step, then
one step under ``MemTracker`` (activation and total peak) and one under
``FlopCounterMode`` (FLOP ratio to ``none``). Step times come last, all modes of
a model in the same process, round-robin (the order rotates each round), each
mode at least ``--steps`` steps and ``--min-seconds`` per round, ``--repeats``
rounds. ``time_ratio`` is a ratio of medians; ``time_ratio_best``, of the
fastest steps, is less sensitive to other processes on a shared machine. A step
is forward, loss and backward (no optimiser: it is the same in every mode). On
CPU ``offload`` has nothing to move. With ``--device cuda`` the models are built
on the GPU, each step is synchronised before its time is taken, and the peaks
are ``torch.cuda.max_memory_allocated``'s (see :func:`cuda_step_memory`; the act
peak is what the forward leaves on the device, which ``offload`` moves to pinned
host memory). ``python -m ckpt_tools.gpu_check`` runs it so on a GPU machine.

``hand`` is the baseline a user writes by hand: the model's ``forward`` calling
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` on every
block. ``full`` must cost the same FLOPs and total peak bytes; its one addition
is the BatchNorm fix's copy of one block's running statistics (pytorch#96136).

ResNet is checkpointed per ``Bottleneck``, not per ``ResStage``: with the default
depths there are 6 bottlenecks but only 3 stages, so ``every_n=2``, ``segments``,
``recursive`` and the auto planner get a chain long enough to differ, and a
bottleneck is the ResNet's counterpart of a ``TransformerBlock`` (the unit a user
would wrap by hand).

``--fit LIMIT`` (off by default: minutes per model) adds a ``fit`` row per model
(``ckpt_tools/fit_check.py``'s ``choose_fit``): ``ckpt=auto ckpt.memory=LIMIT
ckpt.batch=max`` with the model's own optimizer, LIMIT a fraction of the way from
the least whole step to the one without checkpointing (``0.5``) or a size
(``3MiB``): the batch and plan chosen, the whole step predicted (fake tensors) and
measured (MemTracker, real tensors), and samples per second of the training step
(forward, zero_grad, backward, optimizer step; timed as the modes are) against no
checkpointing at the same batch (whether it fits the limit said) and at the
largest batch that fits without checkpointing (searched on fake tensors).

Writes ``results.json`` ({model: {mode: {peak_bytes, act_peak_bytes,
flops_ratio, time_ratio, ...}}}), ``results.md`` and ``plot.png`` into ``--out``;
without matplotlib (an optional dependency, ``ckpt-plugin[bench]``) the two
tables are written and the plot is skipped with one line saying why.
"""

from __future__ import annotations

import argparse
import ast
import gc
import inspect
import itertools
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
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.offload import NOTHING_TO_MOVE
from ckpt_plugin.errors import closest_first
from ckpt_plugin.measure.memory import step_flops, step_memory
from ckpt_plugin.planning.rotor import describe
from ckpt_tools.bench_offload import budget_value, measure_offload, offload_table
from ckpt_tools.compiled import PLUGIN_ROWS, measure_compiled_budget
from ckpt_tools.bench_fit import measure_fit
from ckpt_tools.bench_report import _is_auto, markdown, pareto_front, write_results
from ckpt_tools.fit_check import limit_of
from ckpt_tools.fit_check import parse_list as _parse_list
from ckpt_tools.overhead import measure_overhead
from ckpt_tools.workloads import MODELS, MODES, PRECISIONS, ModelSpec, Run, build

__all__ = ["MODELS", "MODES", "QUICK_MODES", "ModelSpec", "Run", "build", "main", "pareto_front", "write_results"]

MiB = 2**20
EXTRAS = ("overhead", "compiled")
# --quick: one of each kind of mode, ckpt=auto at 0.5 on the GPT only (planning the ResNet's op groups
# takes 15-30 s on 2 cores, auto_min and the small budgets longer), so that the run ends in under two
# minutes on 2 cores (README, Benchmarks).
QUICK_MODES = ("none", "hand", "full", "every_n_2", "segments_sqrt", "selective", "auto_0.5", "offload")
QUICK_SKIPS = {"resnet": ("auto_0.5",)}

def measure_model(
    name: str, modes: list[str], args: argparse.Namespace, bar: tqdm
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Memory and FLOPs per mode (one step each), then interleaved step times; also the model's hparams."""
    spec = MODELS[name]
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    cuda = torch.device(args.device).type == "cuda"
    for mode in modes:
        bar.set_postfix_str(f"{name} {mode}: memory, FLOPs")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run = build(spec, mode, args.quick, device=args.device, sizes=args.sizes.get(name),
                            precision=args.precision)
                run.step()  # warm-up: lazy initialisation (and auto's profiling of the first batch)
                mem = cuda_step_memory(run) if cuda else step_memory(run.step, run.model)
                flops = step_flops(run.step)
            except Exception as err:
                # A budget the planner cannot meet is a result, not a crash: the row says so. With
                # --keep-going (the GPU check's first run on a new machine) so is any other failure.
                refused = isinstance(err, ValueError) and _is_auto(mode)
                if mode == "none" or not (refused or args.keep_going):  # every ratio is to none
                    raise
                rows[mode] = dict.fromkeys(("peak_bytes", "act_peak_bytes", "flops_ratio", "time_ratio")) | {
                    "error": f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)
                }
                run = None  # the failed mode's model and tensors, freed now
                gc.collect()
                if cuda:  # what the failed mode allocated (an out-of-memory) must not count against the next
                    torch.cuda.empty_cache()
                bar.update(1 + args.repeats)
                continue
        # Offload warns once per process that on CPU it has nothing to move; say it on every offload row.
        notes = [n for n in dict.fromkeys(str(w.message) for w in caught) if n != NOTHING_TO_MOVE]
        if mode == "offload" and not cuda:
            notes.insert(0, "on CPU the saved activations already live in host memory: offload moves nothing here")
        runs[mode] = run
        rows[mode] = {"peak_bytes": mem["total"], "act_peak_bytes": mem["act"], "flops": flops,
                      "wrapped": run.wrapped, "notes": notes}
        if cuda:
            rows[mode]["forward_kept_bytes"] = mem["act"]
        if run.planned is not None:  # auto, optimal: what the planner predicted, and what planning cost
            choices = getattr(run.planned, "choices", None)  # options by their names, as the results file keeps them
            rows[mode] |= {"predicted_peak_bytes": run.planned.predicted_peak,
                           "predicted_time_ratio": getattr(run.planned, "predicted_time_ratio", None),
                           "profile_peak_bytes": run.planning_peak_bytes,
                           "choices": {n: str(o) for n, o in choices.items()} if choices
                           else describe(run.planned.schedule)}
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


def cuda_step_memory(run: Run) -> dict[str, int]:
    """One step's CUDA peak as if the model were alone on the device, and what its forward keeps there.

    ``total``: ``torch.cuda.max_memory_allocated`` during the step, less what was
    allocated before it (the other modes' models, still resident for the timing),
    plus this model's parameters and buffers. ``act``: the bytes allocated at the
    end of the forward (the loss computed) beyond those before it: the saved
    activations that stay on the device (``offload`` moves them to pinned host
    memory). Both are counts of the caching allocator's allocations, not of the
    memory it reserves.
    """
    device = run.device
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in itertools.chain(run.model.parameters(), run.model.buffers())}
    gc.collect()
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = run.loss()
    torch.cuda.synchronize(device)  # offload's copies on its side stream have run
    kept = torch.cuda.memory_allocated(device) - start
    loss.backward()
    del loss
    run.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start + sum(state.values())
    return {"total": peak, "act": kept}


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


def command_line(argv: Sequence[str]) -> str:
    prog = Path(sys.argv[0]).name
    prog = "python -m ckpt_tools.bench" if prog in ("bench.py", "__main__.py", "-c", "") else prog
    return " ".join([prog, *map(shlex.quote, argv)])


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


def _parse_sizes(value: str, name: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``n_layer=16,n_embd=2048`` -> constructor keywords of the model, each checked against its signature."""
    valid = [k for k in inspect.signature(MODELS[name].plain.__init__).parameters if k != "self"]
    sizes = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or key not in valid:
            parser.error(f"--{name}: {key!r} is not a keyword of {MODELS[name].plain.__name__}; valid, closest "
                         f"first: {', '.join(closest_first(key, valid))}")
        try:
            sizes[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            parser.error(f"--{name}: {key}={raw!r} is not a Python literal (a number, a tuple, True/False)")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt-bench", description="Every activation-checkpointing mode on the example GPT and ResNet: "
        "activation and total peak memory, FLOP ratio and step-time ratio to no checkpointing."
    )
    parser.add_argument("--out", type=Path, default=Path("bench"),
                        help="directory for results.json, results.md, plot.png (the plot needs matplotlib; "
                        "without it the tables are written and the plot skipped)")
    parser.add_argument("--quick", action="store_true",
                        help=f"under two minutes on 2 CPU cores: small models, the modes {','.join(QUICK_MODES)} "
                        "(ckpt=auto at 0.5 on the GPT only: auto's other budgets and the ResNet's op groups plan "
                        "for longer), 2 timing rounds, and --skip compiled")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of {','.join(MODES)} (default: all of them; --quick: "
                        f"{','.join(QUICK_MODES)}; none is always measured: the reference)")
    parser.add_argument("--repeats", type=int, default=None, help="timing rounds over all modes (default 5, --quick 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per mode per round, at least (default 2, --quick 2)")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="time per mode per round, at least (default 1.0, --quick 0.1)")
    parser.add_argument("--skip", default=None,
                        help=f"comma-separated extras to leave out: {', '.join(EXTRAS)} (overhead: the plugin "
                        "over hand-written checkpoint on a tiny GPT; compiled: torch.compile with "
                        "activation_memory_budget=0.5 beside ckpt=auto 0.5, minutes; --quick skips it unless "
                        "--skip says otherwise, e.g. --skip '')")
    parser.add_argument("--device", default="cpu",
                        help="where the models run: cpu, cuda or cuda:N (on CUDA the peaks are "
                        "torch.cuda.max_memory_allocated's and offload moves to pinned host memory)")
    parser.add_argument("--precision", default="32", choices=list(PRECISIONS),
                        help="32, or bf16-mixed: the forward under torch.autocast(bfloat16), as Lightning's "
                        "precision='bf16-mixed' runs it")
    for name, spec in MODELS.items():
        parser.add_argument(f"--{name}", default="", metavar="KEY=VALUE,...",
                            help=f"{spec.plain.__name__} constructor keywords over the default (or --quick) size, "
                            "e.g. n_layer=16,n_embd=2048" if name == "gpt" else
                            f"{spec.plain.__name__} constructor keywords over the default (or --quick) size")
    parser.add_argument("--fit", default=None, metavar="LIMIT",
                        help="also a 'fit' row per model: ckpt=auto ckpt.memory=LIMIT ckpt.batch=max, LIMIT a "
                        "fraction of the way from the least whole step to the one without checkpointing (0.5) or "
                        "a size (3MiB): the batch and plan chosen, the whole step predicted and measured, samples "
                        "per second against no checkpointing (off by default: minutes per model)")
    parser.add_argument("--offload", default=None, metavar="BUDGET",
                        help="also an 'offload' table per model: every block offloaded, the blocks ckpt=auto "
                        "ckpt.budget=BUDGET offloads, and ckpt=auto at BUDGET with and without offload, against "
                        "none: copies moved and hidden, host allocations per step (ckpt_tools/bench_offload.py)")
    parser.add_argument("--keep-going", action="store_true",
                        help="a mode that fails (an out-of-memory, an error on a new torch) becomes a row naming "
                        "the error instead of ending the run; none must run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    args.steps = args.steps if args.steps is not None else 2
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (0.1 if args.quick else 1.0)
    args.skip = args.skip if args.skip is not None else ("compiled" if args.quick else "")
    for flag in ("repeats", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)} must be >= 1")
    if args.min_seconds < 0:
        parser.error(f"--min-seconds={args.min_seconds} must be >= 0")
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f"--device={args.device!r}: {err}; valid: cpu, cuda, cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device={args.device!r} is not one of cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device={args.device}: torch {torch.__version__} sees no CUDA device")
    models = _parse_list(args.models, list(MODELS), "--models", parser)
    default_modes = QUICK_MODES if args.quick else tuple(MODES)
    modes = _parse_list(args.modes or ",".join(default_modes), list(MODES), "--modes", parser)
    if "none" not in modes:
        modes.insert(0, "none")  # every ratio is to it
    args.sizes = {name: _parse_sizes(getattr(args, name), name, parser) for name in MODELS}
    skipped = _parse_list(args.skip, EXTRAS, "--skip", parser) if args.skip.strip() else []
    if args.fit is not None:
        try:
            limit_of(args.fit, 0, 1)  # its form, before anything runs
        except ValueError as err:
            parser.error(str(err))
    if args.offload is not None:
        try:
            make_config(mode="auto", layers="-", budget=budget_value(args.offload))
        except ValueError as err:
            parser.error(f"--offload={args.offload}: {err}")
    problems = _mode_problems(modes)
    if problems:
        parser.error("\n  ".join(["cannot run:", *problems]))

    command = command_line(argv)
    results, setup = {}, {}
    # --quick's default modes leave out what is slow on one model; modes typed with --modes run everywhere.
    per_model = {name: [m for m in modes if args.modes or m not in QUICK_SKIPS.get(name, ())] if args.quick
                 else modes for name in models}
    total = sum(len(m) for m in per_model.values()) * (1 + args.repeats)
    with tqdm(total=total, desc="ckpt-bench", unit="run", file=sys.stderr) as bar:
        for name in models:
            spec = MODELS[name]
            results[name], hparams = measure_model(name, per_model[name], args, bar)
            setup[name] = (f"{spec.plain.__name__}({', '.join(f'{k}={v}' for k, v in hparams.items())}); "
                           f"layers={spec.layers}; {args.device}, precision {args.precision}; timing: "
                           f"{args.repeats} rounds, each mode at least {args.steps} steps and "
                           f"{args.min_seconds:g} s per round.")

    overhead = compiled = None
    if "overhead" not in skipped:
        print("ckpt-bench: overhead of the plugin over hand-written checkpoint (tiny GPT)", file=sys.stderr)
        overhead = measure_overhead(rounds=5 if args.quick else 15)
    if "compiled" not in skipped:
        print("ckpt-bench: torch.compile: torch's activation_memory_budget and the plugin's modes, compiled "
              f"({2 + len(PLUGIN_ROWS)} compiles: minutes)", file=sys.stderr)
        compiled = measure_compiled_budget(quick=args.quick, rounds=5, steps=1, plugin=list(PLUGIN_ROWS))
    fit = None
    if args.fit is not None:
        print(f"ckpt-bench: --fit {args.fit}: ckpt.batch=max and the plan for the whole step, timed", file=sys.stderr)
        fit = {name: measure_fit(name, args, time_steps) for name in models}
    offload = None
    if args.offload is not None:
        print(f"ckpt-bench: --offload {args.offload}: offload against none, planned and not", file=sys.stderr)
        offload = {name: measure_offload(name, args, time_steps) for name in models}
    extras = {k: v for k, v in (("overhead", overhead), ("compiled", compiled), ("fit", fit), ("offload", offload))
              if v is not None}
    table = markdown(results, command, setup, overhead, compiled, device=args.device, fit=fit)
    if offload is not None:
        table += "\n".join(offload_table(offload))
    print(table)
    written = write_results(args.out, results | extras, table)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
