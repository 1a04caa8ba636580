"""``python -m ckpt_tools.zoo [--min] [--budget[=F]] [NAME ...]``: what ``layers=auto`` chose on each zoo model.

    python -m ckpt_tools.zoo                       # every model; the default table (one step per way)
    python -m ckpt_tools.zoo --budget esm.esm2     # one model, with ckpt=auto ckpt.budget=0.5 as well

Prints, per model: the classes chosen and whether they are the library's own
checkpointed units (``units``: ``=`` or ``DIFF``), the modules wrapped, whether
loss, gradients and buffers are bitwise those without checkpointing, and the
activation peaks (MemTracker, one training step on CPU) without checkpointing
and with ours (and ours/none), with the library's own, ours over theirs, and the
forward's own floor (``measure/floor.py``), checked against the peaks measured.

The costly columns are behind flags, so the default table costs what it did:

``--min`` adds the peak of a step with ``ckpt=auto``'s least plan (``ckpt.budget=min``,
planned from the model's own training call), over none's, and whether it is bitwise; then
whether a budget 10 % above that peak, in bytes, is met (MemTracker) and bitwise.

``--budget`` (``--budget=0.4``: another fraction; 0.5 by default, issue #33) plans
``ckpt=auto`` at that budget and trains: the step's activation peak over none's, its
whole peak (MemTracker's total) beside planning's own (how much the process's peak
resident memory grew while planning: Linux's VmHWM, ``ckpt_tools.workloads.peak_growth``;
the process's first plan carries one-time costs), and ``met`` / ``NO``; refused, the
least reachable peak it names (over none's), then a run with that peak as the budget
in bytes, met or not; a forward that reads values (``measure/values.py``): how many reads
one forward without autograd recorded for planning, and that forward's own peak (MemTracker,
parameters aside); a forward fake tensors still cannot run: ``refused: NotFakeable (...)``.
A model whose step fails is a row saying so, and the exit status is 1.
"""

from __future__ import annotations

import sys

from ckpt_plugin.units import format_bytes
from ckpt_tools.zoo import all_models
from ckpt_tools.zoo.measure import BudgetResult, ZooResult, measure

HALF = 0.5  # issue #33's budget: half the activation peak without checkpointing


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    least = "--min" in args
    flags = [a for a in args if a == "--budget" or a.startswith("--budget=")]
    budget = (float(flags[-1].split("=", 1)[1]) if "=" in flags[-1] else HALF) if flags else None
    wanted = {a for a in args if not a.startswith("--")}
    entries = [e for e in all_models() if not wanted or e.name in wanted]
    print(f"python -m ckpt_tools.zoo{' --min' * least}{f' --budget={budget:g}' if flags else ''}  "
          "(activation peak: MemTracker, one training step, CPU)")
    print(f"{'model':<28}{'family':<16}{'chosen':<40}{'units':>6}{'wrapped':>8}{'bitwise':>8}"
          f"{'none':>11}{'ours':>11}{'ours/none':>10}{'own':>11}{'ours/own':>9}{'floor':>11}"
          + (f"{'min':>11}{'min/none':>9}{'min+10%':>8}" * least)
          + (f"{'/none':>7}{'step':>11}{'planning':>11}  ckpt.budget={budget:g}" if flags else ""))
    worst = 0.0
    floors: list[tuple[str, int, int]] = []  # (model, floor, the least peak measured)
    results, failed = [], []
    for entry in entries:
        try:
            r = measure(entry, least=least, budget=budget)
        except Exception as err:  # noqa: BLE001 - a table of many models: one that fails is a row, not the end
            failed.append(entry.name)
            print(f"{entry.name:<28}{entry.family:<16}failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        results.append(r)
        chosen = ", ".join(r.note.split(" chose ", 1)[1].split(" (", 1)[0].split(", "))
        same = "=" if _units_same(r) else "DIFF"
        own = format_bytes(r.own.act_peak) if r.own else "-"
        ratio = f"{r.ours_over_own:.3f}" if r.own else "-"
        worst = max(worst, r.ours_over_own or 0.0)
        print(f"{entry.name:<28}{entry.family:<16}{chosen[:39]:<40}{same:>6}{len(r.wrapped):>8}"
              f"{'yes' if not r.mismatches else 'NO':>8}{format_bytes(r.none.act_peak):>11}"
              f"{format_bytes(r.ours.act_peak):>11}{r.ours.act_peak / r.none.act_peak:>10.3f}{own:>11}{ratio:>9}"
              f"{format_bytes(r.floor) if r.floor is not None else '-':>11}" + (_least_columns(r) if least else "")
              + (_budget_columns(r.budget, r) if r.budget else ""))
        if r.floor is not None:
            peaks = [r.none, r.ours, *([r.least] if r.least else [])]
            floors.append((entry.name, r.floor, min(run.act_peak for run in peaks)))
    print(f"{len(entries)} models; the largest ours/own: {worst:.3f}; auto chose the library's own units on "
          f"{sum(_units_same(r) for r in results)} of {len(results)}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if least:
        planned = [r for r in results if r.least is not None]
        exact = sum(not r.least_mismatches for r in planned)
        print(f"ckpt=auto ckpt.budget=min planned {len(planned)} of them (the others cannot run on fake tensors): "
              f"bitwise on {exact}; min/none from {min((_ratio(r) for r in planned), default=0):.3f} to "
              f"{max((_ratio(r) for r in planned), default=0):.3f}; a budget of 1.1x min's peak met, bitwise, on "
              f"{sum(r.above_met for r in planned)}")
    if flags:
        print(_budget_summary(budget, [r.budget for r in results]))
    above = [name for name, floor, least in floors if floor > least]
    print(f"the forward's floor (what no checkpointing goes below), measured on {len(floors)} of them: "
          + (f"ABOVE a measured peak on {', '.join(above)}" if above else "at most every measured peak"))
    return 1 if failed else 0


def _units_same(r: ZooResult) -> bool:
    return tuple(r.note.split(" chose ", 1)[1].split(" (", 1)[0].split(", ")) == r.entry.units


def _ratio(r: ZooResult) -> float:
    return r.least.act_peak / r.none.act_peak


def _least_columns(r: ZooResult) -> str:
    """``--min``'s columns: the peak with ckpt=auto's least plan and its share of none's (marked when not bitwise)."""
    if r.least is None:
        return f"{'-':>11}{'-':>9}{'-':>8}"
    mark = "" if not r.least_mismatches else " NOT BITWISE"
    return f"{format_bytes(r.least.act_peak):>11}{_ratio(r):>9.3f}{'met' if r.above_met else 'NO':>8}{mark}"


def _budget_columns(b: BudgetResult, r: ZooResult) -> str:
    """``--budget``'s columns: the step's activation peak over none's, its whole peak, planning's, the outcome."""
    if b.run is None:
        return f"{'-':>7}{'-':>11}{'-':>11}  refused: {b.refused}"
    mark = "" if not b.mismatches else " NOT BITWISE"
    verdict = "met" if b.met else ("NO" if b.refused is None else "NOT met")
    outcome = verdict if b.refused is None else f"refused ({b.refused}), then {verdict}"
    planning = format_bytes(b.planning_peak) if b.planning_peak is not None else "-"
    n = b.values.reads if b.values is not None else 0
    read = (f"; {n} read{'s' * (n != 1)} of values recorded at a peak of {format_bytes(b.values.peak_bytes)}"
            if b.values is not None else "")
    return (f"{b.run.act_peak / r.none.act_peak:>7.3f}{format_bytes(b.run.total_peak):>11}{planning:>11}"
            f"  {outcome}{mark}{read}")


def _budget_summary(budget: float, runs: list[BudgetResult]) -> str:
    met = sum(b.met and b.refused is None for b in runs)
    rerun = [b for b in runs if b.refused is not None and b.run is not None]
    fake = sum(b.run is None for b in runs)
    return (f"ckpt=auto ckpt.budget={budget:g}: met on {met} of {len(runs)}; refused with a reachable least on "
            f"{len(rerun)}, that least then met on {sum(b.met for b in rerun)}; refused NotFakeable on {fake}")


if __name__ == "__main__":
    raise SystemExit(main())
