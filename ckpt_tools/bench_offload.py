"""``ckpt-bench --offload BUDGET``: whether offload hides behind compute, on the bench's GPT (issue #41).

    ckpt-bench --models gpt --modes none --offload 0.25 --device cuda --precision bf16-mixed --gpt n_layer=16,...

Rows, each timed interleaved with ``none`` (medians), on the model and device the bench runs:

- ``offload``: every block offloaded (``ckpt=offload``): its step time, the bytes its copies move per step
  (the installation's own count), their serial time at the link's measured bandwidth, and the share of that
  time hidden, ``1 - (offload - none) / serial``; host allocations after each of the first steps (the pool:
  none after the first);
- ``offload planned``: ``ckpt=offload`` on exactly the blocks ``ckpt=auto ckpt.budget=BUDGET`` offloads (what
  the plan deems hideable), against ``none`` (the issue's mark: within 5 %);
- ``auto``, ``auto no offload``: ``ckpt=auto ckpt.budget=BUDGET`` with offload allowed and with
  ``ckpt.offload=false``, at the same memory: step time, predicted against measured, options chosen.

On a CPU there is no link: offload moves nothing, the plan offloads nothing, and the rows say so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from tqdm import tqdm

from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.wrap import offloaders_of
from ckpt_plugin.planning.link import measure_link
from ckpt_tools.workloads import MODELS, Run, build

MiB = 2 ** 20
_FIRST_STEPS = 4  # steps whose host allocations are counted one by one


def measure_offload(name: str, args: argparse.Namespace, time_steps: Any) -> dict[str, Any]:
    """``--offload``'s rows for model ``name`` (``time_steps``: the bench's interleaved timer)."""
    spec, device = MODELS[name], torch.device(args.device)
    link = measure_link(device)
    budget = budget_value(args.offload)

    def fresh(keys: dict[str, Any] | None) -> Run:
        run = build(spec, "none", args.quick, device=args.device, sizes=args.sizes.get(name), precision=args.precision)
        if keys is not None:
            run.wrapped = len(apply_config(run.model, make_config(**keys), run.loss))
        return run

    runs: dict[str, Run] = {"none": fresh(None), "offload": fresh({"mode": "offload", "layers": spec.layers})}
    allocations, moved = [], []
    (offloader,) = offloaders_of(runs["offload"].model)
    for _ in range(_FIRST_STEPS):  # the pool grows on the first step, and never after
        before = offloader.stats.bytes_out
        runs["offload"].step()
        allocations.append(offloader.host_allocations)
        moved.append(offloader.stats.bytes_out - before)
    planned = {}
    for label, allowed in (("auto", True), ("auto no offload", False)):
        keys = {"mode": "auto", "layers": spec.layers, "budget": budget, "offload": allowed}
        run = build(spec, "none", args.quick, device=args.device, sizes=args.sizes.get(name), precision=args.precision)
        plan = _planned(run, keys)
        runs[label], planned[label] = run, plan
    chosen = planned["auto"].choices if planned["auto"] is not None else {}
    hideable = [n for n, o in chosen.items() if str(o) == "offload"]
    if hideable:
        pattern = "re:^(" + "|".join(n.replace(".", r"\.") for n in hideable) + ")$"
        runs["offload planned"] = fresh({"mode": "offload", "layers": pattern})
    with tqdm(total=args.repeats * len(runs), desc=f"ckpt-bench --offload {name}", unit="run",
              file=sys.stderr) as bar:
        seconds = time_steps(f"{name} offload", runs, args.repeats, args.steps, args.min_seconds, bar)
    step = {k: statistics.median(v) for k, v in seconds.items()}
    serial = None
    if link is not None and moved[-1]:
        serial = moved[-1] / link.out_bytes_per_s + moved[-1] / link.back_bytes_per_s
    rows = {"link": str(link) if link is not None else None, "budget": args.offload,
            "none_step_s": step["none"], "offload_step_s": step["offload"],
            "moved_bytes_per_step": moved[-1], "host_allocations_after_step": allocations,
            "copy_serial_s": serial,
            "hidden": None if serial is None else 1 - (step["offload"] - step["none"]) / serial,
            "hideable_layers": hideable,
            "planned_offload_step_s": step.get("offload planned")}
    for label, plan in planned.items():
        rows[label] = None if plan is None else {
            "step_s": step[label], "time_ratio": step[label] / step["none"],
            "predicted_time_ratio": plan.predicted_time_ratio, "predicted_peak_bytes": plan.predicted_peak,
            "offload_bytes": plan.offload_bytes, "choices": {n: str(o) for n, o in plan.choices.items()}}
    return rows


def budget_value(text: str) -> float | str:
    """``--offload``'s budget as ``ckpt.budget`` takes it: a fraction (0.25) or a size (2GiB)."""
    try:
        return float(text)
    except ValueError:
        return text


def _planned(run: Run, keys: dict[str, Any]) -> Any:
    """Plan ``keys`` on ``run``'s model with its own loss, install it; the planner's Plan (None: refused)."""
    from ckpt_plugin.apply.plan import plan_for
    from ckpt_plugin.engine.wrap import install

    try:
        plan = plan_for(run.model, make_config(**keys), run.loss)
    except ValueError as err:  # a budget this model cannot meet is a row that says so
        print(f"ckpt-bench --offload: {keys}: {err}", file=sys.stderr)
        return None
    run.wrapped = len(install(run.model, plan))
    return plan.planned


def offload_table(offload: dict[str, dict[str, Any]]) -> list[str]:
    """``--offload``'s rows as markdown."""
    lines = ["## offload", "",
             "Every block offloaded (`ckpt=offload`), the blocks `ckpt=auto` offloads at the budget (`offload "
             "planned`), and `ckpt=auto` at that budget with and without offload, each timed interleaved with "
             "`none` (medians). Hidden: 1 - (offload - none) / (the bytes moved, out and back, at the link's "
             "measured bandwidth).", "",
             "| model | link | moved per step | serial copies | none | offload | hidden | host allocations, "
             "steps 1-4 | offload planned (blocks) |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for model, r in offload.items():
        serial = f"{r['copy_serial_s'] * 1e3:.1f} ms" if r["copy_serial_s"] is not None else "–"
        hidden = f"{r['hidden']:.2f}" if r["hidden"] is not None else "–"
        planned = (f"{r['planned_offload_step_s'] * 1e3:.1f} ms ({len(r['hideable_layers'])}, "
                   f"{r['planned_offload_step_s'] / r['none_step_s']:.3f}x none)"
                   if r["planned_offload_step_s"] is not None else "the plan offloads nothing")
        lines.append(f"| {model} | {r['link'] or 'none (CPU: nothing moves)'} | {r['moved_bytes_per_step'] / MiB:.1f}"
                     f" MiB | {serial} | {r['none_step_s'] * 1e3:.1f} ms | {r['offload_step_s'] * 1e3:.1f} ms "
                     f"| {hidden} | {', '.join(map(str, r['host_allocations_after_step']))} | {planned} |")
    lines += ["", "| model | budget | plan | step | measured / none | predicted / none | offloaded per step |",
              "|---|---|---|---:|---:|---:|---:|"]
    for model, r in offload.items():
        for label in ("auto", "auto no offload"):
            p = r[label]
            if p is None:
                lines.append(f"| {model} | {r['budget']} | {label}: refused | | | | |")
                continue
            counts: dict[str, int] = {}
            for option in p["choices"].values():
                counts[option] = counts.get(option, 0) + 1
            predicted = f"{p['predicted_time_ratio']:.3f}" if p["predicted_time_ratio"] is not None else "–"
            lines.append(f"| {model} | {r['budget']} | {label}: {', '.join(f'{o} x{n}' for o, n in counts.items())} "
                         f"| {p['step_s'] * 1e3:.1f} ms | {p['time_ratio']:.3f} | {predicted} "
                         f"| {p['offload_bytes'] / MiB:.1f} MiB |")
    return [*lines, ""]


__all__ = ["budget_value", "measure_offload", "offload_table"]
