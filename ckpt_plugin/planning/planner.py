"""The exact planner behind ``ckpt=auto``: one option per layer, least recompute under a budget.

The peak model, written here once (``recorder.py`` measures its numbers), with
the layers in the order they run::

    peak = max(max_i(kept[1] + ... + kept[i-1] + running[i]),  # while layer i runs or recomputes
               kept[1] + ... + kept[L] + rest_running)          # while the head and loss run

While layer ``i`` runs forward, only the layers before it hold anything for
backward. While it recomputes in backward, the layers after it have already
run their backward and freed what they kept. So a layer's running bytes add
to what the layers before it keep, not to what every layer keeps: on a
ResNet, whose first blocks have the largest activations, this is the
difference between a useful bound and one that refuses every budget. The model
assumes backward visits the layers in reverse order (a chain of blocks); it is
exact for such a chain except that a tensor two layers keep counts twice.

For a given budget, feasibility of what is left depends only on the bytes kept
so far, so a dynamic programme over the layers that keeps the Pareto frontier
of (bytes kept so far, cost) is exact: no discretisation, no solver. The cost
is the step time an option adds (measured, ``timing.py``), then recomputed
FLOPs, then how intrusive the option is.

A layer's options need not be the three above: ``inside.py`` adds, for a
layer whose parts (child modules) were measured too, options that checkpoint
parts of it (the layer unwrapped, or itself ``full`` with parts checkpointed
inside its recomputation), each a :class:`Cost` whose ``parts`` say which. The
DP here treats them as any other option; a :class:`Plan` lists the parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ckpt_plugin.config.budget import cannot_meet
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.memory import REST
from ckpt_plugin.planning.frontier import pareto
from ckpt_plugin.planning.nofit import NoFit
from ckpt_plugin.planning.offload_plan import Clocks, fastest_as_simulated, last_back, simulated_seconds
from ckpt_plugin.engine.offload_copies import PREFETCH_AHEAD
from ckpt_plugin.planning.options import KEEP, OPTIONS, Option
from ckpt_plugin.units import format_bytes

@dataclass(frozen=True)
class Part:
    """A part of a layer (a child module, or a child's child) and what an inside option does to it."""

    name: str
    option: Option  # its kind: selective, full or inside (never keep: parts left as they are are not listed)
    kept_bytes: int
    recompute_flops: int


@dataclass(frozen=True)
class Cost:
    """What one option of one layer costs.

    ``kept_bytes``: kept for backward; ``recompute_flops``: recomputed in
    backward; ``running_bytes``: alive while it runs beyond what the other
    layers keep (its running bytes, ``profile.py``); ``seconds``: the step
    time the option adds over ``keep`` (0 until ``timing.py`` measures it);
    ``parts``: for an option inside the layer, its parts checkpointed (or
    themselves inside), in the order they run, a part's own parts after it;
    ``backward_running``: for a part, its running bytes when it runs inside its
    layer's recomputation, in backward, where the loss is alive too (None: not measured).
    For an offload option (``offload_plan.py``): ``moved_bytes`` of what the option it
    offloads keeps leave the device (in flight beside the next layers until copied, and back
    beside the layer before it in backward), its copies carry ``copied_bytes`` each way, and
    ``exposed_seconds`` of its ``seconds`` are copy time the compute does not hide.
    """

    kept_bytes: int
    recompute_flops: int
    running_bytes: int
    seconds: float = 0.0
    parts: tuple[Part, ...] = ()
    backward_running: int | None = None
    moved_bytes: int = 0
    copied_bytes: int = 0
    exposed_seconds: float = 0.0


@dataclass(frozen=True)
class LayerProfile:
    name: str
    options: dict[Option, Cost]  # an option of OPTIONS (and inside.py's options inside it) -> Cost


@dataclass(frozen=True)
class Profile:
    """:func:`profile`'s answer: the layers in the order they run, and the model outside them."""

    layers: list[LayerProfile]
    rest_bytes: int  # kept for backward outside the candidate layers
    rest_running: int  # alive outside the layers at worst beyond the layers' keeps (the rest's running bytes)
    no_ckpt_peak: int  # act peak of the step without checkpointing, as measured
    none_seconds: float = 0.0  # the step without checkpointing, predicted from timings (0: not timed)
    timed_as: str = ""  # how the options were timed: "eager", or which ran compiled ("": not timed)
    # Inside the layers (inside.py): each measured part's own options, and each layer's or part's chain of parts.
    parts: dict[str, dict[str, Cost]] = field(default_factory=dict)
    chains: dict[str, Any] = field(default_factory=dict)  # name -> inside.Chain
    # A plan's activation peak, measured (profile.py: one step on fake tensors with the plan on); None: not offered.
    measure: Callable[[Plan], int] | None = field(default=None, compare=False, repr=False)
    regrouped: tuple[str, ...] = ()  # layers measured as op groups (op_groups.py): their parts are groups
    # Offload (offload_plan.py): the timeline its options are priced on (None: no link, none offered), and the
    # line plans say of it (the link, or why offload was no option; "": not considered).
    clocks: Clocks | None = field(default=None, compare=False, repr=False)
    offload_note: str = ""

    def plan(self, budget_bytes: int) -> Plan:
        """:meth:`fit`, raising the one "cannot be met" :class:`ConfigError` where no plan fits."""
        return _fitted(self.fit(budget_bytes))

    def fit(self, budget_bytes: int) -> Plan | NoFit:
        """The planner's choice for ``budget_bytes``, its peak measured before it is taken; or why none fits.

        The peak model is exact for the layers' own options on the example models and, as
        tested, for their parts; not on every model (Hugging Face's Funnel pools between its
        layers), and inside a layer a part's bytes may be shared with its layer's own ops in
        ways no single number describes. So the chosen plan runs once on fake tensors
        (``measure``: eager steps), and when it holds more than the budget, what it held
        beyond its prediction is charged to the options it took (those inside layers where
        it went inside; else every one but ``keep``) and it is planned again, a few times.
        Then the least plan stands in, if it fits: a budget that ``ckpt.budget=min``'s plan
        meets is never refused (each try lowers the estimate, not the target: the case
        behind it, Hugging Face's CodeGen, is in CHANGELOG.md under issue #23).
        """
        layers, measured = self.layers, []
        for _ in range(_TRIES):
            chosen = choose(layers, self.rest_bytes, budget_bytes, rest_running=self.rest_running,
                            reference_peak=self.no_ckpt_peak, none_seconds=self.none_seconds, clocks=self.clocks,
                            offload_note=self.offload_note)
            if isinstance(chosen, NoFit):  # none predicted to fit: the least plan may measure less than predicted
                break
            chosen = replace(chosen, budget_bytes=budget_bytes, timed_as=self.timed_as)
            inside = len(chosen.choices) > len(self.layers)
            ran = self._measured(chosen, said=inside)
            if ran.predicted_peak <= budget_bytes:  # without ``measure``: as planned, which fits
                return ran
            measured.append(ran.predicted_peak)
            charged = _held_more(layers, chosen.keys, max(ran.predicted_peak - chosen.predicted_peak, 1),
                                 inside_only=inside)
            if charged == layers:  # nothing to charge (every layer kept): planned again, it would come back
                break
            layers = charged
        least = self.least()
        if least.predicted_peak <= budget_bytes:
            return replace(least, budget_bytes=budget_bytes)
        return NoFit(budget_bytes, min(measured + [least.predicted_peak]), self.no_ckpt_peak)

    def _measured(self, chosen: Plan, said: bool = False) -> Plan:
        """``chosen`` with its peak measured (one step on fake tensors), said so in its summary where ``said`` (a
        plan inside a layer) or where it differs from the model's (exact on the example models' layers; not on
        every model: Funnel pools between its layers). As it is without ``measure``."""
        if self.measure is None:
            return chosen
        peak = self.measure(chosen)
        if any(o.offload for o in chosen.keys):  # fake steps see no copy in flight nor prefetched: the model does
            peak = max(peak, chosen.predicted_peak)
        if not said and peak == chosen.predicted_peak:
            return chosen
        return replace(chosen, predicted_peak=peak, peak_measured=True)

    def least(self) -> Plan:
        """``ckpt.budget=min``: the cheapest plan among those of the least predicted peak, its peak measured
        where it goes inside a layer (and that peak its budget: what it was planned to hold).

        Inside a layer the prediction is not exact, so a plan predicted to hold more (or as much) may
        measure less. So the options inside layers that the chosen plan took are charged what it held
        beyond its prediction (at least a byte: a tie is looked past too), and the least is planned
        again, until a plan comes back or a few were measured; the lowest measured is kept (so one
        more candidate layer can never raise ``min``'s peak; the case behind it, Hugging Face's
        BERT, is in CHANGELOG.md). A heuristic: the plan it keeps is the lowest of those it
        measured, not of all plans.
        """
        layers, best, seen = self.layers, None, set()
        for _ in range(_TRIES):
            ahead = self.clocks.ahead if self.clocks is not None else PREFETCH_AHEAD
            chosen = plan(layers, self.rest_bytes, smallest_peak(layers, self.rest_running, ahead),
                          rest_running=self.rest_running, reference_peak=self.no_ckpt_peak,
                          none_seconds=self.none_seconds, clocks=self.clocks, offload_note=self.offload_note)
            chosen = replace(chosen, timed_as=self.timed_as)
            if self.measure is None or len(chosen.choices) == len(self.layers):  # nothing inside: exact, or measured
                chosen = self._measured(chosen)
                if best is None or chosen.predicted_peak < best.predicted_peak:
                    best = chosen
                break
            if chosen.keys in seen:
                break
            seen.add(chosen.keys)
            ran = self._measured(chosen, said=True)
            if best is None or ran.predicted_peak < best.predicted_peak:
                best = ran
            layers = _held_more(layers, chosen.keys, max(ran.predicted_peak - chosen.predicted_peak, 1))
        return replace(best, budget_bytes=best.predicted_peak)


def _held_more(layers: list[LayerProfile], keys: tuple[Option, ...], more: int,
               inside_only: bool = True) -> list[LayerProfile]:
    """``layers`` with each option inside a layer that ``keys`` chose (one per layer) running on ``more`` bytes:
    what a measured plan held beyond its prediction, charged to the options the model is not exact for.
    ``inside_only=False`` (a plan of the layers' own options that held more: Funnel's layers, whose pooling the
    model does not see): every option it chose but ``keep``."""
    def charged(option: Option, cost: Cost) -> bool:
        return bool(cost.parts) if inside_only else option != KEEP

    return [LayerProfile(layer.name, {o: replace(c, running_bytes=c.running_bytes + more) if o == key and charged(o, c)
                                      else c for o, c in layer.options.items()})
            for layer, key in zip(layers, keys, strict=True)]


@dataclass(frozen=True)
class Plan:
    """One option per layer, the least recompute whose predicted activation peak fits.

    ``choices``: every layer's option (``keep``, ``selective``, ``full`` or
    ``inside``: unwrapped, parts of it checkpointed), each followed by the parts
    its option checkpoints inside it (qualified names, e.g. ``blocks.3.mlp``), with theirs.
    """

    choices: dict[str, Option]  # each as its layer's row names it: the option's kind (Option.kind)
    recompute_flops: int
    recompute_seconds: float  # step time the chosen options add (0 without a timing)
    predicted_peak: int
    budget_bytes: int
    rows: list[tuple[str, str, int, int]] = field(repr=False)  # layer or part, option named, kept bytes, recompute FLOPs
    rest_bytes: int = 0
    peak_at: str = REST  # the layer whose run (or recomputation) the predicted peak falls in
    none_seconds: float = 0.0  # the step without checkpointing, predicted (0: not timed)
    timed_as: str = ""  # how the options were timed (Profile.timed_as)
    peak_measured: bool = False  # predicted_peak is the plan's own, measured on fake tensors (Profile.plan)
    keys: tuple[Option, ...] = ()  # each layer's option as its profile has it (``inside#3``), in layer order
    offload_bytes: int = 0  # what the offloaded layers copy out (and back) per step
    offload_exposed_seconds: float = 0.0  # the copy time the compute does not hide, simulated (offload_plan.py)
    offload_note: str = ""  # the link offload was priced on, or why it was no option ("": not considered)

    @property
    def predicted_time_ratio(self) -> float | None:
        """The step with this plan over the step without checkpointing, predicted; None if not timed."""
        added = self.recompute_seconds + self.offload_exposed_seconds
        return (self.none_seconds + added) / self.none_seconds if self.none_seconds > 0 else None

    def __str__(self) -> str:
        # A part is indented under its layer (and a part's part under it): depth = listed ancestors.
        # "planned kept" is the planner's own count, not the report's "kept" (docs/measure.md: a tensor two
        # layers keep is the later one's, a layer's inputs are its own under every option).
        names = [n for n, *_ in self.rows]
        shown = ["  " * sum(n.startswith(a + ".") for a in names) + n for n in names]
        width = max(len("total"), len(REST), *(len(n) for n in shown))
        wide = max(len("selective"), *(len(o) for _, o, _, _ in self.rows))
        lines = [f"{'layer':<{width}}  {'option':<{wide}}  {'planned kept':>12}  {'recompute FLOPs':>16}"]
        lines += [f"{n:<{width}}  {o:<{wide}}  {format_bytes(b):>12}  {f:>16,}"
                  for n, (_, o, b, f) in zip(shown, self.rows)]
        lines.append(f"{REST:<{width}}  {'':<{wide}}  {format_bytes(self.rest_bytes):>12}")
        kept = self.rest_bytes + sum(b for n, _, b, _ in self.rows if not any(n.startswith(a + ".") for a in names))
        lines.append(f"{'total':<{width}}  {'':<{wide}}  {format_bytes(kept):>12}  {self.recompute_flops:>16,}")
        how = "measured with the plan on (fake tensors)" if self.peak_measured else f"while {self.peak_at} runs"
        lines.append(f"predicted activation peak {format_bytes(self.predicted_peak)} ({self.predicted_peak} B), "
                     f"{how}, <= budget {format_bytes(self.budget_bytes)} ({self.budget_bytes} B)")
        if shown != names:
            lines.append("indented: parts checkpointed inside the layer above (inside: the layer runs unwrapped; "
                         "under a full layer: inside its recomputation); the layer's row includes them")
        if self.offload_bytes:
            lines.append(f"offloads {format_bytes(self.offload_bytes)} per step each way; "
                         f"{1e3 * self.offload_exposed_seconds:.1f} ms of the copies exposed (two streams simulated "
                         f"over the layers' times)")
        if self.offload_note:
            lines.append(self.offload_note)
        if self.predicted_time_ratio is not None:
            copies = f" and {1e3 * self.offload_exposed_seconds:+.1f} ms of copies" if self.offload_bytes else ""
            lines.append(f"predicted step time {self.predicted_time_ratio:.2f}x that without checkpointing "
                         f"({1e3 * self.recompute_seconds:+.1f} ms of recomputation{copies}, measured layer by layer"
                         + (f", {self.timed_as})" if self.timed_as else ")"))
        elif self.timed_as:  # timed, but the step without checkpointing came out <= 0 (noise on a loaded machine)
            lines.append(f"options chosen by added step time ({1e3 * self.recompute_seconds:+.1f} ms of "
                         f"recomputation, measured layer by layer, {self.timed_as}); the step without "
                         "checkpointing could not be predicted from these timings, so no ratio")
        return "\n".join(lines)


_TRIES = 4  # plans measured for one budget, each planned with what the last held over its prediction charged


def _fitted(chosen: Plan | NoFit) -> Plan:
    """``chosen``, or the budget's one "cannot be met" error (``config.budget.cannot_meet``) for a :class:`NoFit`."""
    if isinstance(chosen, NoFit):
        raise ConfigError([cannot_meet(chosen.budget_bytes, chosen.least, chosen.reference,
                                       by="checkpointing ckpt.layers", hint=", or select more layers")])
    return chosen


def _cost(option: Option, cost: Cost) -> tuple[float, int, int]:
    # Step time first (what users pay); then FLOPs (FlopCounterMode misses elementwise
    # recompute), then the lighter option.
    return cost.seconds, cost.recompute_flops, OPTIONS.index(option) if option in OPTIONS else len(OPTIONS)


def predicted_peak(profiles: list[LayerProfile], chosen: tuple[Option, ...],
                   rest_running: int = 0, ahead: int = PREFETCH_AHEAD) -> tuple[int, str]:
    """The peak model above for one choice of options, and where the peak falls (a layer, or REST).

    The rest's kept bytes are inside every running-bytes figure, so they take no term of their own.
    What the last ``ahead`` offloaded layers move counts beside every later layer's running bytes and
    the rest's (``offload_plan.py``: in flight out in forward, prefetched back in backward).
    """
    kept, pending, terms = 0, (), []
    for layer, option in zip(profiles, chosen):
        cost = layer.options[option]
        terms.append((kept + cost.running_bytes + sum(pending), layer.name))
        kept += cost.kept_bytes
        pending = _after(pending, cost, ahead)
    peak, at = kept + rest_running + sum(pending), REST
    for term, name in terms:
        if term > peak:
            peak, at = term, name
    return peak, at


def _after(pending: tuple[int, ...], cost: Cost, ahead: int) -> tuple[int, ...]:
    """The bytes moved by the last ``ahead`` offloaded layers, once a layer under ``cost`` has run: the
    dynamic programmes' state beside the bytes kept so far (a single empty state without offload)."""
    if not cost.moved_bytes or not ahead:
        return pending
    return (*pending, cost.moved_bytes)[-ahead:]


def _cheapest(profiles: list[LayerProfile], budget: int, rest_running: int, ahead: int = PREFETCH_AHEAD,
              clocks: Clocks | None = None):
    """(cost, choices) of the least recompute whose peak fits ``budget``, or None.

    Frontier entries are (bytes kept so far, cost, choices): bytes ascending, cost
    strictly descending. Keeping fewer bytes never makes a later option infeasible,
    so a dominated entry can never be completed more cheaply. One frontier per state
    of what the last offloaded layers moved (:func:`_after`): one in all without offload;
    with ``clocks``, the state's copy back, on demand, is added at the end (``last_back``).
    """
    frontiers: dict[tuple[int, ...], list] = {(): [(0, (0.0, 0, 0), ())]}
    for layer in profiles:
        grown: dict[tuple[int, ...], list] = {}
        for pending, frontier in frontiers.items():
            for kept, (seconds, flops, level), chosen in frontier:
                for o, c in layer.options.items():
                    if kept + c.running_bytes + sum(pending) <= budget:
                        t, f, n = _cost(o, c)
                        grown.setdefault(_after(pending, c, ahead), []).append(
                            (kept + c.kept_bytes, (seconds + t, flops + f, level + n), chosen + (o,)))
        frontiers = {pending: pareto(sorted(entries), lambda entry: entry[:2]) for pending, entries in grown.items()}
    fits = [((cost[0] + last_back(clocks, pending), *cost[1:]) if pending and clocks else cost, chosen)
            for pending, frontier in frontiers.items() for kept, cost, chosen in frontier
            if kept + rest_running + sum(pending) <= budget]
    return min(fits) if fits else None


def smallest_peak(profiles: list[LayerProfile], rest_running: int = 0, ahead: int = PREFETCH_AHEAD) -> int:
    """The least predicted peak any choice reaches: a frontier of (bytes kept so far, running peak) per state."""
    frontiers: dict[tuple[int, ...], list] = {(): [(0, 0)]}
    for layer in profiles:
        grown: dict[tuple[int, ...], set] = {}
        for pending, frontier in frontiers.items():
            for kept, peak in frontier:
                for c in layer.options.values():
                    grown.setdefault(_after(pending, c, ahead), set()).add(
                        (kept + c.kept_bytes, max(peak, kept + c.running_bytes + sum(pending))))
        frontiers = {pending: pareto(sorted(entries), lambda entry: entry) for pending, entries in grown.items()}
    return min(max(peak, kept + rest_running + sum(pending))
               for pending, frontier in frontiers.items() for kept, peak in frontier)


def plan(profiles: list[LayerProfile], rest_bytes: int, budget_bytes: int, **options: Any) -> Plan:
    """:func:`choose`, raising the one "cannot be met" :class:`ConfigError` where no choice fits."""
    return _fitted(choose(profiles, rest_bytes, budget_bytes, **options))


def choose(
    profiles: list[LayerProfile],
    rest_bytes: int,
    budget_bytes: int,
    *,
    rest_running: int = 0,
    reference_peak: int | None = None,
    none_seconds: float = 0.0,
    clocks: Clocks | None = None,
    offload_note: str = "",
) -> Plan | NoFit:
    """The choice of options with the least added step time (then FLOPs) whose predicted peak fits ``budget_bytes``;
    a :class:`NoFit` with the least peak any choice reaches where none does.

    ``profiles`` are in the order the layers run. Ties go to the less
    intrusive options. ``reference_peak`` (the activation peak without
    checkpointing) only words errors. ``clocks``: where layers have offload options
    (``offload_plan.py``), the timeline that prices the copies the plan exposes (the plan
    kept is the fastest as simulated); ``offload_note``: the plan's line on offload.
    """
    if not profiles:
        raise ValueError("ckpt=auto: nothing to choose from: ckpt.layers selected no layers; name the "
                         "repeated blocks of the model, e.g. ckpt.layers=TransformerBlock")
    assert all(p.options for p in profiles), "every layer needs at least one option"
    if reference_peak is not None and budget_bytes >= reference_peak and all(KEEP in p.options for p in profiles):
        # The measured step without checkpointing fits, so keeping everything (no recompute) is the
        # plan, even where the peak model, an upper bound, says otherwise (it counts twice a tensor
        # that two layers keep).
        best = ((0.0, 0, 0), tuple(KEEP for _ in profiles))
    else:
        ahead = clocks.ahead if clocks is not None else PREFETCH_AHEAD
        best = _cheapest(profiles, budget_bytes, rest_running, ahead, clocks)
        if best is not None and clocks is not None and any(o.offload for o in best[1]):
            best = fastest_as_simulated(profiles, best, lambda layers: _cheapest(layers, budget_bytes, rest_running,
                                                                                 ahead, clocks), clocks)
    if best is None:
        smallest = smallest_peak(profiles, rest_running)
        # Without a measured reference, the model's own peak with every layer kept (or keeping the most).
        most = tuple(KEEP if KEEP in p.options else max(p.options, key=lambda o: p.options[o].kept_bytes)
                     for p in profiles)
        reference = reference_peak or predicted_peak(profiles, most, rest_running)[0]
        return NoFit(budget_bytes, smallest, reference)
    cost, chosen = best
    peak, at = predicted_peak(profiles, chosen, rest_running, clocks.ahead if clocks is not None else PREFETCH_AHEAD)
    seconds, exposed, moved = cost[0], 0.0, 0
    if any(o.offload for o in chosen):  # priced by the timeline, not by the options' sum
        seconds, exposed = simulated_seconds(profiles, chosen, clocks)
        seconds -= exposed
        moved = sum(p.options[o].copied_bytes for p, o in zip(profiles, chosen) if o.offload)
    if reference_peak is not None and set(chosen) == {KEEP}:
        peak, at = min(peak, reference_peak), at  # nothing checkpointed: the measured peak is the peak
    listed = []  # each layer under its option's kind, then the parts it checkpoints inside it
    for p, o in zip(profiles, chosen):
        listed.append((p.name, o.kind, p.options[o].kept_bytes, p.options[o].recompute_flops))
        listed += [(part.name, part.option, part.kept_bytes, part.recompute_flops) for part in p.options[o].parts]
    rows = [(name, str(option), kept, flops) for name, option, kept, flops in listed]
    return Plan(
        choices={name: option for name, option, _, _ in listed},
        recompute_flops=cost[1],
        recompute_seconds=seconds,
        predicted_peak=peak,
        budget_bytes=budget_bytes,
        rows=rows,
        rest_bytes=rest_bytes,
        peak_at=at,
        none_seconds=none_seconds,
        keys=chosen,
        offload_bytes=moved,
        offload_exposed_seconds=exposed,
        offload_note=offload_note,
    )
