"""The GPU check's tables (``gpu_check.py`` writes them into ``summary.md``), and offload's overlap read off the bench.

    summary(results)          # every table of the check, as markdown, from its results.json
    offload_overlap(rows, bw) # offload against none: the copies' share hidden
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ckpt_tools.bench_offload import offload_table

MiB = 2**20


def offload_overlap(rows: dict[str, dict[str, Any]], bandwidth: dict[str, float] | None) -> dict[str, Any] | None:
    """Offload against none on the bench's GPT: step times, bytes left on the device, the copies' share hidden.

    ``hidden``: 1 - (offload's added step time) / (the moved bytes' copy time out and back at the measured
    bandwidth): 1 when the copies cost nothing, 0 when they cost what they would serially.
    """
    none, off = rows.get("none"), rows.get("offload")
    if not none or not off or off.get("step_seconds") is None or none.get("step_seconds") is None:
        return None
    result = {"none_step_s": none["step_seconds"], "offload_step_s": off["step_seconds"],
              "added_s": off["step_seconds"] - none["step_seconds"],
              "none_kept_bytes": none.get("forward_kept_bytes"), "offload_kept_bytes": off.get("forward_kept_bytes"),
              "none_peak_bytes": none["peak_bytes"], "offload_peak_bytes": off["peak_bytes"],
              "moved_bytes": None, "copy_s": None, "hidden": None}
    if result["none_kept_bytes"] is not None and result["offload_kept_bytes"] is not None:
        result["moved_bytes"] = moved = result["none_kept_bytes"] - result["offload_kept_bytes"]
        if bandwidth and moved > 0:
            result["copy_s"] = moved / bandwidth["d2h_bytes_per_s"] + moved / bandwidth["h2d_bytes_per_s"]
            result["hidden"] = 1 - result["added_s"] / result["copy_s"]
    return result


def _cell(text: str, limit: int = 300) -> str:
    """One markdown table cell: one line, no column separators."""
    return " ".join(str(text).split()).replace("|", "/")[:limit]


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / MiB:.1f}"


def skip_reasons(rows: list[dict[str, Any]]) -> dict[str, int]:
    """``{reason: how many}`` of the skipped ``rows``, the most frequent first."""
    return dict(Counter(r["message"] or "(no reason given)" for r in rows if r["outcome"] == "skipped").most_common())


def summary(results: dict[str, Any], table_modes: tuple[str, ...], fit: tuple[str, str], fsdp_fit: dict[str, Any],
            status: Any) -> str:
    """Every table of the check, as markdown. ``table_modes``: the bench's rows, in order; ``fit``: ``bench fit``'s
    limit and GPT; ``fsdp_fit``: the FSDP step's run; ``status``: a step's status from its results entry."""
    env = results["env"] or {}
    lines = ["# GPU check", "", "```bash", results["command"], "```", "",
             f"{'Dry run on CPU (tiny sizes). ' if results['dry_run'] else ''}"
             f"{results['seconds']:.0f} s in all, {results['started']}.", "", "## Environment", "",
             "| what | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()] or ["| (the environment step printed nothing) | |"]
    lines += ["", "## Steps", "", "| step | status | seconds | log |", "|---|---|---:|---|"]
    lines += [f"| {s['name']} | {status(s)} | {s['seconds']:.1f} | {s['log']} |" for s in results["steps"]]
    tests = results["tests"]
    lines += ["", "## CUDA-only tests", "", "| test | outcome | seconds | message |", "|---|---|---:|---|"]
    lines += [f"| {r['id']} | {r['outcome']} | {r['seconds']:.2f} | {_cell(r['message'])} |" for r in tests["cuda"]]
    core = tests["core"]
    lines += ["", "## Core subset", "", "| tests | passed | failed | errors | skipped |", "|---|---:|---:|---:|---:|",
              f"| {', '.join(f.removeprefix('tests/') for f in core['files'])} | {core['passed']} | {core['failed']} "
              f"| {core['errors']} | {core['skipped']} |"]
    if core["not_passed"]:
        lines += ["", *(f"- {r['id']}: {r['outcome']}: {_cell(r['message'])}" for r in core["not_passed"])]
    if core.get("skip_reasons"):  # a skip is not a pass: say what each stands for
        lines += ["", "Skipped, by reason:", "",
                  *(f"- {n} skipped: {_cell(reason)}" for reason, n in core["skip_reasons"].items())]
    bench = results["bench"]
    lines += ["", "## ckpt-bench", "", bench["setup"], "",
              "| mode | step (ms) | time / none | peak (MiB) | peak / none | kept by the forward (MiB) "
              "| kept / none | FLOP ratio | note |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for mode in table_modes:
        r = bench["rows"].get(mode)
        if r is None:
            lines.append(f"| {mode} | – | – | – | – | – | – | – | not measured: see the steps |")
        elif r.get("error") or r.get("time_ratio") is None:
            lines.append(f"| {mode} | – | – | – | – | – | – | – | {_cell(r.get('error', ''))} |")
        else:
            kept = r.get("forward_kept_bytes", r["act_peak_bytes"])
            lines.append(f"| {mode} | {r['step_seconds'] * 1e3:.1f} | {r['time_ratio']:.2f} | {_mib(r['peak_bytes'])} "
                         f"| {r['peak_fraction']:.2f} | {_mib(kept)} | {r['act_fraction']:.2f} "
                         f"| {r['flops_ratio']:.3f} | {_cell('; '.join(r.get('notes', [])))} |")
    lines += ["", "Ratios are to `none` of the same bench run (auto's own run measures its `none` again). "
              "On CUDA the peak is torch.cuda.max_memory_allocated's for the step, as if the model were alone; "
              "'kept by the forward' is what the forward leaves allocated on the device. On CPU both are "
              "MemTracker's (total and activation peaks)."]
    bw, ov = results["bandwidth"], results["offload"]
    lines += ["", "## Offload's overlap", ""]
    if bw:
        lines.append(f"Pinned copies of 1 GiB: device to host {bw['d2h_bytes_per_s'] / 1e9:.1f} GB/s, "
                     f"host to device {bw['h2d_bytes_per_s'] / 1e9:.1f} GB/s.")
        lines.append("")
    if ov is None:
        lines.append("No offload and none rows with step times to compare (see the steps).")
    else:
        fmt = (lambda v, f: "–" if v is None else f.format(v))
        lines += ["| none step (ms) | offload step (ms) | added (ms) | kept on device: none (MiB) | offload (MiB) "
                  "| moved (MiB) | copies out and back, serial (ms) | share hidden |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {ov['none_step_s'] * 1e3:.1f} | {ov['offload_step_s'] * 1e3:.1f} | {ov['added_s'] * 1e3:.1f} "
                  f"| {_mib(ov['none_kept_bytes'])} | {_mib(ov['offload_kept_bytes'])} | {_mib(ov['moved_bytes'])} "
                  f"| {fmt(ov['copy_s'] and ov['copy_s'] * 1e3, '{:.1f}')} | {fmt(ov['hidden'], '{:.2f}')} |"]
    lines += ["", "## Offload that hides (`ckpt-bench --offload`)", ""]
    engine = results.get("offload_engine")
    lines += offload_table({"gpt": engine}) if engine else ["Not measured (see the steps)."]
    lines += ["", "## Fit the device (ckpt.memory, ckpt.batch=max)", ""]
    fit_limit, fit_gpt = fit  # the argument; the measured row is `row`
    row = results.get("fit")
    if not row:
        lines.append("Not measured (see the steps)." if not results["dry_run"] else "Not run in a dry run.")
    else:
        lines += [f"`ckpt-bench --fit {fit_limit}` on GPT({fit_gpt}), bf16-mixed: the limit halfway between the least "
                  "whole step and the one without checkpointing.", "",
                  "| limit (MiB) | batch | plan | predicted (MiB) | MemTracker (MiB) | max_memory_allocated (MiB) "
                  "| reserved (MiB) | allocated <= limit |", "|---:|---:|---|---:|---:|---:|---:|---|",
                  f"| {_mib(row['limit'])} | {row['batch']} | {row['plan']} | {_mib(row['predicted'])} "
                  f"| {_mib(row['measured'])} | {_mib(row.get('cuda_allocated'))} | {_mib(row.get('cuda_reserved'))} "
                  f"| {'yes' if (row.get('cuda_allocated') or 0) <= row['limit'] else 'NO'} |", "",
                  "The allocator's overhead is max_memory_allocated against MemTracker's total, and what it reserved "
                  "against what it allocated."]
    lines += _sharded(results, "fsdp_fit", "Under FSDP (Lightning's FSDPStrategy, one GPU)", fsdp_fit)
    lines += _sharded(results, "fsdp2_fit", "Under FSDP2 (ModelParallelStrategy, a world of one)",
                      {**fsdp_fit, "memory": "device"})
    return "\n".join(lines) + "\n"


def _sharded(results: dict[str, Any], key: str, title: str, run: dict[str, Any]) -> list[str]:
    """The section of one sharded fit step (tests/fit_fsdp_worker.py --cuda): ``results[key]`` is its rank's
    record, ``run`` the run it was given."""
    lines = ["", f"## {title}", ""]
    fsdp = results.get(key)
    if not fsdp:
        return [*lines, "Not measured (see the steps)." if not results["dry_run"] else "Not run in a dry run."]
    if fsdp.get("error"):
        return [*lines, f"Failed: {_cell(': '.join(fsdp['error']))}"]
    cuda_peak = fsdp.get("cuda_peak")
    return [*lines, f"`tests/fit_fsdp_worker.py --cuda`: GPT({run['gpt']}), batch {run['data_batch']}, "
            f"{run['precision']}, AdamW, ckpt.memory={run['memory']}; the whole step predicted on the "
            "fake twin sharded as the module is, measured at the second batch.", "",
            "| limit (MiB) | wrapped | predicted (MiB) | MemTracker (MiB) | max_memory_allocated (MiB) "
            "| allocated <= limit |", "|---:|---:|---:|---:|---:|---|",
            f"| {_mib(fsdp.get('limit'))} | {len(fsdp['wrapped'])} | {_mib(fsdp['predicted'])} "
            f"| {_mib(fsdp['measured'])} | {_mib(cuda_peak)} "
            f"| {'yes' if cuda_peak is not None and cuda_peak <= (fsdp.get('limit') or 0) else 'NO'} |"]


__all__ = ["offload_overlap", "skip_reasons", "summary"]
