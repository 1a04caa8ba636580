"""``python -m ckpt_tools.zoo [--min] [NAME ...]``: what ``layers=auto`` chose on each zoo model, its activation peak.

Prints, per model: the classes chosen, the modules wrapped, whether loss,
gradients and buffers are bitwise those without checkpointing, and the
activation peaks (MemTracker, one training step on CPU) without
checkpointing, with ours and with the library's own, ours over theirs, and
the forward's own floor (``measure/floor.py``), checked against the peaks measured.
``--min`` adds the peak of a step with ``ckpt=auto``'s least plan (``ckpt.budget=min``,
planned from the model's own training call), over none's, and whether it is bitwise; then
whether a budget 10 % above that peak, in bytes, is met (MemTracker) and bitwise.
"""

from __future__ import annotations

import sys

from ckpt_plugin.units import format_bytes
from ckpt_tools.zoo import all_models
from ckpt_tools.zoo.measure import ZooResult, measure


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    least = "--min" in args
    wanted = {a for a in args if a != "--min"}
    entries = [e for e in all_models() if not wanted or e.name in wanted]
    print(f"python -m ckpt_tools.zoo{' --min' * least}  (activation peak: MemTracker, one training step, CPU)")
    print(f"{'model':<28}{'family':<16}{'chosen':<46}{'wrapped':>8}{'bitwise':>8}"
          f"{'none':>11}{'ours':>11}{'own':>11}{'ours/own':>9}{'floor':>11}"
          + (f"{'min':>11}{'min/none':>9}{'min+10%':>8}" * least))
    worst = 0.0
    floors: list[tuple[str, int, int]] = []  # (model, floor, the least peak measured)
    results = []
    for entry in entries:
        r = measure(entry, least=least)
        results.append(r)
        chosen = ", ".join(r.note.split(" chose ", 1)[1].split(" (", 1)[0].split(", "))
        own = format_bytes(r.own.act_peak) if r.own else "-"
        ratio = f"{r.ours_over_own:.3f}" if r.own else "-"
        worst = max(worst, r.ours_over_own or 0.0)
        print(f"{entry.name:<28}{entry.family:<16}{chosen[:45]:<46}{len(r.wrapped):>8}"
              f"{'yes' if not r.mismatches else 'NO':>8}{format_bytes(r.none.act_peak):>11}"
              f"{format_bytes(r.ours.act_peak):>11}{own:>11}{ratio:>9}"
              f"{format_bytes(r.floor) if r.floor is not None else '-':>11}" + (_least_columns(r) if least else ""))
        if r.floor is not None:
            peaks = [r.none, r.ours, *([r.least] if r.least else [])]
            floors.append((entry.name, r.floor, min(run.act_peak for run in peaks)))
    print(f"{len(entries)} models; the largest ours/own: {worst:.3f}")
    if least:
        planned = [r for r in results if r.least is not None]
        exact = sum(not r.least_mismatches for r in planned)
        print(f"ckpt=auto ckpt.budget=min planned {len(planned)} of them (the others cannot run on fake tensors): "
              f"bitwise on {exact}; min/none from {min((_ratio(r) for r in planned), default=0):.3f} to "
              f"{max((_ratio(r) for r in planned), default=0):.3f}; a budget of 1.1x min's peak met, bitwise, on "
              f"{sum(r.above_met for r in planned)}")
    above = [name for name, floor, least in floors if floor > least]
    print(f"the forward's floor (what no checkpointing goes below), measured on {len(floors)} of them: "
          + (f"ABOVE a measured peak on {', '.join(above)}" if above else "at most every measured peak"))
    return 0


def _ratio(r: ZooResult) -> float:
    return r.least.act_peak / r.none.act_peak


def _least_columns(r: ZooResult) -> str:
    """``--min``'s columns: the peak with ckpt=auto's least plan and its share of none's (marked when not bitwise)."""
    if r.least is None:
        return f"{'-':>11}{'-':>9}{'-':>8}"
    mark = "" if not r.least_mismatches else " NOT BITWISE"
    return f"{format_bytes(r.least.act_peak):>11}{_ratio(r):>9.3f}{'met' if r.above_met else 'NO':>8}{mark}"


if __name__ == "__main__":
    raise SystemExit(main())
