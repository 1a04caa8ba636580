"""The exact planner behind ``ckpt=auto``: one option per layer, least recompute under a budget.

For each possible largest transient, a dynamic programme over the layers keeps
the Pareto frontier of (kept bytes, recompute FLOPs): exact, no discretisation,
no solver. See ``auto.py`` for the peak model and how the costs are measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .measure import REST, format_bytes

OPTIONS = ("keep", "selective", "full")  # in order of intrusiveness: ties in FLOPs go left


@dataclass(frozen=True)
class Cost:
    """What one option of one layer costs: bytes kept for backward, FLOPs recomputed, bytes while it runs."""

    kept_bytes: int
    recompute_flops: int
    transient_bytes: int


@dataclass(frozen=True)
class LayerProfile:
    name: str
    options: dict[str, Cost]  # "keep" / "selective" / "full" -> Cost


@dataclass(frozen=True)
class Profile:
    """:func:`profile`'s answer: the layers, and the model outside them."""

    layers: list[LayerProfile]
    rest_bytes: int  # kept for backward outside the candidate layers
    rest_transient: int  # unkept activations alive outside the layers at worst
    no_ckpt_peak: int  # act peak of the step without checkpointing, as measured

    def plan(self, budget_bytes: int) -> Plan:
        return plan(self.layers, self.rest_bytes, budget_bytes,
                    rest_transient=self.rest_transient, reference_peak=self.no_ckpt_peak)


# ---------------------------------------------------------------------- planning

@dataclass(frozen=True)
class Plan:
    """One option per layer, the least recompute whose predicted activation peak fits."""

    choices: dict[str, str]
    recompute_flops: int
    predicted_peak: int
    budget_bytes: int
    rows: list[tuple[str, str, int, int]] = field(repr=False)  # layer, option, kept bytes, recompute FLOPs
    rest_bytes: int = 0
    transient_bytes: int = 0

    def __str__(self) -> str:
        width = max(len("(largest transient)"), *(len(r[0]) for r in self.rows))
        lines = [f"{'layer':<{width}}  {'option':<9}  {'kept':>10}  {'recompute FLOPs':>16}"]
        lines += [f"{n:<{width}}  {o:<9}  {format_bytes(b):>10}  {f:>16,}" for n, o, b, f in self.rows]
        lines.append(f"{REST:<{width}}  {'':<9}  {format_bytes(self.rest_bytes):>10}")
        lines.append(f"{'(largest transient)':<{width}}  {'':<9}  {format_bytes(self.transient_bytes):>10}")
        peak, flops = format_bytes(self.predicted_peak), self.recompute_flops
        lines.append(f"{'total (peak)':<{width}}  {'':<9}  {peak:>10}  {flops:>16,}")
        lines.append(f"predicted activation peak {format_bytes(self.predicted_peak)} ({self.predicted_peak} B) "
                     f"<= budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B)")
        return "\n".join(lines)


def _cost(option: str, cost: Cost) -> tuple[int, int]:
    # FLOPs first; FlopCounterMode misses elementwise recompute, so ties go to the lighter option.
    return cost.recompute_flops, OPTIONS.index(option) if option in OPTIONS else len(OPTIONS)


def _frontier(layers: list[LayerProfile], cap: int) -> list[tuple[int, tuple[int, int], tuple[str, ...]]]:
    """Pareto frontier of (kept bytes, cost) over all choices whose transients are <= ``cap``:
    bytes ascending, cost strictly descending; exact (every byte count kept as is)."""
    frontier: list[tuple[int, tuple[int, int], tuple[str, ...]]] = [(0, (0, 0), ())]
    for layer in layers:
        allowed = [(o, c) for o, c in layer.options.items() if c.transient_bytes <= cap]
        if not allowed:
            return []
        grown = sorted(
            (b + c.kept_bytes, (f + _cost(o, c)[0], n + _cost(o, c)[1]), chosen + (o,))
            for b, (f, n), chosen in frontier for o, c in allowed
        )
        frontier = []
        for entry in grown:
            if not frontier or entry[1] < frontier[-1][1]:
                frontier.append(entry)
    return frontier


def plan(
    profiles: list[LayerProfile],
    rest_bytes: int,
    budget_bytes: int,
    *,
    rest_transient: int = 0,
    reference_peak: int | None = None,
) -> Plan:
    """The choice of options with the least recompute FLOPs whose predicted peak fits ``budget_bytes``.

    Exact: for every value T the largest transient can take, a dynamic programme
    over the layers keeps the Pareto frontier of (kept bytes, recompute) using only
    options whose transient is at most T; the best fitting entry over all T wins.
    ``reference_peak`` (the activation peak without checkpointing) only words errors.
    """
    if not profiles:
        raise ValueError("ckpt=auto: nothing to choose from: ckpt.layers selected no layers; name the "
                         "repeated blocks of the model, e.g. ckpt.layers=TransformerBlock")
    assert all(p.options for p in profiles), "every layer needs at least one option"
    caps = sorted({rest_transient} | {c.transient_bytes for p in profiles for c in p.options.values()
                                       if c.transient_bytes > rest_transient})
    best, smallest = None, math.inf
    for cap in caps:
        frontier = _frontier(profiles, cap)
        if not frontier:
            continue
        smallest = min(smallest, rest_bytes + frontier[0][0] + cap)
        fits = [e for e in frontier if rest_bytes + e[0] + cap <= budget_bytes]
        if fits:
            kept, cost, chosen = fits[-1]  # the most bytes that fit: the least cost
            peak = rest_bytes + kept + max([rest_transient] + [p.options[o].transient_bytes
                                                               for p, o in zip(profiles, chosen)])
            if best is None or (cost, peak) < best[:2]:
                best = (cost, peak, chosen)
    if best is None:
        # Without a measured reference, the model's own peak with every layer kept (or keeping the most).
        most = [p.options.get("keep") or max(p.options.values(), key=lambda c: c.kept_bytes) for p in profiles]
        reference = reference_peak or (rest_bytes + sum(c.kept_bytes for c in most)
                                       + max([rest_transient] + [c.transient_bytes for c in most]))
        raise ValueError(
            f"ckpt.budget: {budget_bytes} bytes ({format_bytes(budget_bytes)}, {budget_bytes / reference:.2f} of "
            f"the activation peak without checkpointing, {format_bytes(reference)}) cannot be met by "
            f"checkpointing ckpt.layers: the smallest peak reachable is {smallest} bytes ({format_bytes(smallest)}, "
            f"{smallest / reference:.2f}); raise ckpt.budget to at least "
            f"{math.ceil(smallest / reference * 100) / 100:g} or {smallest} bytes, or select more layers"
        )
    cost, peak, chosen = best
    rows = [(p.name, o, p.options[o].kept_bytes, p.options[o].recompute_flops) for p, o in zip(profiles, chosen)]
    return Plan(
        choices={p.name: o for p, o in zip(profiles, chosen)},
        recompute_flops=cost[0],
        predicted_peak=peak,
        budget_bytes=budget_bytes,
        rows=rows,
        rest_bytes=rest_bytes,
        transient_bytes=peak - rest_bytes - sum(r[2] for r in rows),
    )
