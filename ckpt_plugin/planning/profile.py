"""``ckpt=auto``: choose per layer what to checkpoint so that activations fit a budget.

    python recipes/train.py ckpt=auto ckpt.layers=TransformerBlock ckpt.budget=0.4
    python recipes/train.py ckpt=auto ckpt.layers=TransformerBlock ckpt.budget=2GiB

Each candidate layer gets one of three options: ``keep`` (no checkpointing),
``selective`` (the ``matmuls`` policy) or ``full``. :func:`profile` measures,
on fake tensors (``measure/fake.py``: exact bytes and FLOPs, no memory, so
profiling never needs the step the user turned checkpointing on to avoid),
with every candidate wrapped with one option at a time, what each layer keeps
for backward, the FLOPs its recomputation adds, and what is alive while it
runs. ``planning/timing.py`` adds what each option costs in step time,
measured on real tensors one layer at a time. :func:`plan` (``planner.py``)
then picks the options with the least added step time (FLOPs without a
timing) whose predicted activation peak fits, exactly: a dynamic programme,
no ILP solver (torch's ``_tools/sac_ilp.py`` needs pulp) and no
``torch.compile`` (torchtitan's ``MemoryBudgetAC`` needs it). With ``depth``
(``ckpt=auto``: ``INSIDE_DEPTH``), the layers' parts (child modules, and
theirs) are measured and timed the same way, level by level, and become more
options of their layer (``inside.py``): checkpointed inside it, so that a
budget under what ``full`` on a layer reaches can be met. A layer that cannot
run under a selective option (its caller writes in place into an output the
policy saved: ``policies.SavedOutputModified``) is profiled, timed and planned
without it.

How each number is measured, and the peak model it feeds, is in
``recorder.py``; one recorded step with the candidates under given options is
``steps.py``; the layers' parts are measured in ``parts.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ckpt_plugin.engine.plan import EachLayer, WrapPlan
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.engine.wrap import checkpointing_disabled
from ckpt_plugin.measure.fake import fake_measurement
from ckpt_plugin.measure.memory import REST
from ckpt_plugin.measure.values import with_values_replayed
from ckpt_plugin.planning.inside import with_inside
from ckpt_plugin.planning.layer_times import LayerTimes, TimingCache
from ckpt_plugin.planning.offload_plan import Link, Moves, with_offload
from ckpt_plugin.planning.options import FULL, KEEP, OPTIONS, SELECTIVE, SELECTIVE_NB, Option
from ckpt_plugin.planning.options import offered as offered_options  # noqa: I001 (two names of one module)
from ckpt_plugin.planning.parts import measure_parts, ran_as_groups, regrouped_while
from ckpt_plugin.planning.planner import Cost, LayerProfile, Plan, Profile
from ckpt_plugin.planning.recorder import Recorder
from ckpt_plugin.planning.rotor import ChainCosts
from ckpt_plugin.planning.steps import recorded_step, step_where_it_runs, treatment
from ckpt_plugin.planning.timing import check_candidates, measure_layer_times

INSIDE_DEPTH = 2  # ckpt=auto: a layer's children and their children are candidates too


@dataclass
class ProfileCache:
    """What :func:`profile` measured of one model, kept by the caller to profile it again deeper.

    ``ckpt=auto`` profiles the layers, and only after a refusal their parts too:
    the second profile reads back the layers' steps (by the candidates' names)
    and timings instead of running them again.
    """

    timings: TimingCache = field(default_factory=dict)
    # (names, fake) -> (recorder by option, FLOPs by option and layer, options by layer it cannot run under)
    steps: dict[tuple[tuple[str, ...], bool], tuple[dict[Option, Recorder], dict[Option, dict[str, int]],
                                                    dict[str, set[Option]]]] = field(default_factory=dict)
    # (a plan's choices, the layers regrouped, fake) -> its activation peak (``Profile.measure``): the strategies
    # check the same plan again (ckpt.memory's least plan, a budget's first fit; on the example GPT 11 checks
    # were 6 plans), and each check is a whole recorded step.
    peaks: dict[tuple[tuple[tuple[str, Option], ...], tuple[str, ...], bool], int] = field(default_factory=dict)


def profile(model: nn.Module, names: list[str], forward: Callable[[], Any], *, fake: bool = True,
            timed: bool = False, compiled: Mapping[Option, str] | None = None, depth: int = 0,
            cache: ProfileCache | None = None, timing_forward: Callable[[], Any] | None = None,
            link: Link | None = None, no_link: str = "") -> Profile:
    """Measure every option of every candidate layer (qualified names) on fake tensors.

    ``forward()`` runs the model on a sample batch and returns the loss. Three
    steps in all, each with every candidate wrapped one way (keep, selective,
    full), each recording memory and counting FLOPs (recomputed ones included). They
    run on fake tensors (``measure/fake.py``): bytes and FLOPs are the real
    ones and no activation is allocated, whatever the batch; ``fake=False``
    runs them on real tensors (for tests that compare the two). ``timed=True``
    also measures what each option adds to the step time (``timing.py``: real
    tensors, one layer at a time, never the un-checkpointed step), which the
    planner then minimises; ``compiled`` (option -> backend) times those options
    compiled, as the step will run them (``measure_layer_times``). They leave no trace: RNG streams, buffers,
    gradients and wrapping are restored.

    ``depth``: how many levels of parts (child modules) below each layer are
    candidates too (``inside.py``; ``ckpt=auto`` asks for ``INSIDE_DEPTH``).
    Each level costs three more steps, every part of that level under one
    option at a time, and its parts are timed as the layers are (alike parts
    once); their options reach a layer as options inside it. ``cache``: a
    :class:`ProfileCache` the caller keeps, so that profiling the same model
    again (deeper) neither steps nor times its layers again. ``timing_forward``: the forward the options are
    timed on, on real tensors (``ckpt.batch=max`` plans a larger batch than the loader's, and times on the
    loader's: the options' added times scale alike with the batch, so the planner's choice does not change);
    ``forward`` by default. ``link``: where timed, each layer gets offload options too, priced on this host link
    (``offload_plan.py``); None: none, and the plan says ``no_link`` of it (``link.host_link`` words it).
    """
    names = list(dict.fromkeys(names))
    check_candidates(model, names)

    def measured() -> Profile:
        with checkpointing_disabled(model), contextlib.ExitStack() as stack:
            return _profile(model, names, forward, fake=fake, timed=timed, compiled=compiled, depth=depth,
                            cache=ProfileCache() if cache is None else cache, stack=stack,
                            timing_forward=timing_forward or forward, link=link, no_link=no_link)

    return with_values_replayed(model, forward, measured) if fake else measured()


def _profile(model: nn.Module, names: list[str], forward: Callable[[], Any], *, fake: bool, timed: bool,
             compiled: Mapping[Option, str] | None, depth: int, cache: ProfileCache,
             stack: contextlib.ExitStack, timing_forward: Callable[[], Any], link: Link | None,
             no_link: str) -> Profile:
    """:func:`profile`, with the layers unwrapped. The layers are stepped as they are; for their parts
    (``depth``), those with op groups run regrouped (``op_groups.py``) until ``stack`` closes."""
    silenced = cache_warnings_silenced()  # its wrappers are for a moment: the installation warns, once
    grouped: tuple[str, ...] = ()
    with silenced, fake_measurement(model, "ckpt=auto's profile") as mode:
        mode = mode if fake else None
        if (tuple(names), fake) not in cache.steps:
            stepped = {KEEP: recorded_step(model, names, forward, KEEP, fake=mode)}
            # Without a batched matmul in the layers, selective_nb saves what selective saves (linear layers
            # only) or what full does (convolutions): no option of its own, so no step of its own either.
            offered = [o for o in offered_options(OPTIONS) if o != SELECTIVE_NB or stepped[KEEP].batched]
            lacking: dict[str, set[Option]] = {}  # layer -> options it cannot run under
            for option in offered[1:]:
                stepped[option], without = step_where_it_runs(model, names, forward, option, mode)
                for name in without:
                    lacking.setdefault(name, set()).add(option)
            cache.steps[tuple(names), fake] = (
                stepped, {option: dict(r.flops) if option != KEEP else {} for option, r in stepped.items()}, lacking)
        recorders, flops, lacking = cache.steps[tuple(names), fake]
        memory = {option: recorder.analyse() for option, recorder in recorders.items()}
        moved = {option: recorders[option].moves(recorders[option].kept_owner) for option in (KEEP, FULL)}
        forward_running = {name: recorders[FULL].unit_forward.get((name, 0), 0) for name in names}
        grouped = ran_as_groups(model, names, forward, mode, stack.enter_context(regrouped_while(model, names))) \
            if depth else ()
        if grouped:  # a full layer with parts inside it runs regrouped: a traced forward may free sooner
            full = recorded_step(model, names, forward, FULL, fake=mode)
            forward_running |= {name: full.unit_forward.get((name, 0), 0) for name in grouped}
        parts, chains = measure_parts(model, names, forward, mode, depth, forward_running)
    layers = [
        LayerProfile(name, {
            option: Cost(kept.get(name, 0), flops[option].get(name, 0), running.get(name, 0))
            for option, (kept, running, _peak) in memory.items() if option not in lacking.get(name, ())
        })
        for name in names
    ]
    layers = _useful_options(layers)
    # The planner's peak model follows the order the layers run in; layers that never ran go last.
    ran = recorders[KEEP].order
    layers.sort(key=lambda layer: ran.index(layer.name) if layer.name in ran else len(ran))
    measured = Profile(
        layers=layers,
        rest_bytes=max(kept.get(REST, 0) for kept, _, _ in memory.values()),
        rest_running=max(running.get(REST, 0) for _, running, _ in memory.values()),
        no_ckpt_peak=memory[KEEP][2],
        parts=parts,
        chains=chains,
        # A plan's own step on fake tensors: eager only (a compiled step keeps what its partitioner chooses).
        measure=(lambda chosen: _cached_peak(cache, model, forward, chosen.choices, fake, grouped))
        if chains or not compiled else None,
        regrouped=grouped,
    )
    if not timed:
        return _with_inside(measured)
    timed_parts = {name: list(options) for name, options in parts.items() if len(options) > 1}
    measured_options = [*(layer.options for layer in measured.layers), *parts.values()]
    offered = [o for o in OPTIONS if any(o in options for options in measured_options)]
    with cache_warnings_silenced():
        times = measure_layer_times(model, names, timing_forward, {o: treatment(o) for o in offered},
                                    compiled={o: b for o, b in (compiled or {}).items() if o in offered},
                                    parts=timed_parts, cache=cache.timings, whole_step=KEEP in (compiled or {}),
                                    layer_options={layer.name: list(layer.options) for layer in measured.layers})
    moves = {name: Moves({o: moved[o][0].get(name, 0) for o in moved}, {o: moved[o][1].get(name, 0) for o in moved})
             for name in names}
    return with_offload(with_times(measured, times), times, moves, link, no_link)


def _useful_options(layers: list[LayerProfile]) -> list[LayerProfile]:
    """``layers`` without ``selective_nb`` where it is no option of its own: on no layer does it keep less than
    ``selective`` and more than ``full`` (a ResNet's blocks have no matmul it saves, so it would keep what
    ``full`` keeps, recomputing as much, through a policy). Then it is neither timed nor planned with."""

    def between(layer: LayerProfile) -> bool:
        o = layer.options
        if SELECTIVE_NB in o and SELECTIVE not in o:  # selective cannot run here: selective_nb is the one
            return True
        return SELECTIVE_NB in o and o[FULL].kept_bytes < o[SELECTIVE_NB].kept_bytes < o[SELECTIVE].kept_bytes

    if all(SELECTIVE_NB not in layer.options for layer in layers) or any(between(layer) for layer in layers):
        return layers
    return [replace(layer, options={o: c for o, c in layer.options.items() if o != SELECTIVE_NB}) for layer in layers]


def _cached_peak(cache: ProfileCache, model: nn.Module, forward: Callable[[], Any], choices: Mapping[str, Option],
                 fake: bool, grouped: tuple[str, ...]) -> int:
    """:func:`_plan_peak`, each plan measured once per profiled model (``ProfileCache.peaks``)."""
    key = (tuple(choices.items()), grouped, fake)
    if key not in cache.peaks:
        cache.peaks[key] = _plan_peak(model, forward, choices, fake, grouped)
    return cache.peaks[key]


def _plan_peak(model: nn.Module, forward: Callable[[], Any], choices: Mapping[str, Option], fake: bool,
               grouped: tuple[str, ...] = ()) -> int:
    """The activation peak of one step with ``choices`` on (a plan's: nested names nest), measured as profiled."""
    def measured() -> int:
        with (cache_warnings_silenced(), checkpointing_disabled(model),
              regrouped_while(model, _regrouped(grouped, choices)),
              fake_measurement(model, "ckpt=auto's profile") as mode):
            return recorded_step(model, list(choices), forward, dict(choices), fake=mode if fake else None).analyse()[2]

    return with_values_replayed(model, forward, measured) if fake else measured()


def _with_inside(measured: Profile) -> Profile:
    """``measured`` with each layer's options inside it (``inside.py``), from its parts' options and chains."""
    if not measured.chains:
        return measured
    leaves = {layer.name: {o: c for o, c in layer.options.items() if o.parts is None} for layer in measured.layers}
    layers = [LayerProfile(layer.name, with_inside(layer.name, leaves | measured.parts, measured.chains))
              for layer in measured.layers]
    return replace(measured, layers=layers)


def with_times(measured: Profile, times: LayerTimes) -> Profile:
    """``measured`` with each option's added step time from ``times``.

    An option timed eagerly adds at least nothing: it runs what ``keep`` runs and
    more, so a negative difference is the machine's noise, read as 0. One timed
    compiled may save time: fused, a recomputation costs less than writing and
    reading back what it replaces (on the example GPT, CPU inductor, ``selective``
    on every block is 5 % faster than compiled ``none``; issue #22), and a layer
    ``ckpt.compile`` compiles runs faster than the eager one it replaces; so its
    difference stands, negative or not, and the planner takes the faster plan.

    Where an option was timed compiled, its kept bytes are what its compiled call
    keeps (``LayerTimes.kept_bytes``), its running bytes move by as much, and the
    peak without checkpointing, when ``keep`` ran compiled, by the sum over the
    layers: the step as it will run. The rest of the model keeps its eager bytes,
    or, where the whole step was measured compiled (``compiled_rest_bytes``), the
    larger of those and what it keeps compiled.
    """
    layers, shift = [], 0
    for layer in measured.layers:
        compiled = times.kept_bytes.get(layer.name, {})
        options = {}
        for o, c in layer.options.items():
            if o.parts is not None:  # an option inside the layer: made again below, from its parts' times
                continue
            added = times.added(layer.name, o)
            c = replace(c, seconds=added if o in times.compiled else max(added, 0.0))
            if o in compiled:
                delta = compiled[o] - c.kept_bytes
                c = replace(c, kept_bytes=compiled[o], running_bytes=max(c.running_bytes + delta, compiled[o]))
            options[o] = c
        shift += compiled[KEEP] - layer.options[KEEP].kept_bytes if KEEP in compiled else 0
        layers.append(LayerProfile(layer.name, options))
    parts = {name: {o: replace(c, seconds=max(times.added(name, o), 0.0)) for o, c in options.items()}
             if name in times.seconds else options for name, options in measured.parts.items()}
    rest = max(times.compiled_rest_bytes or 0, measured.rest_bytes) - measured.rest_bytes
    return _with_inside(replace(measured, layers=layers, parts=parts, none_seconds=times.predicted_none_seconds,
                                timed_as=times.how, no_ckpt_peak=measured.no_ckpt_peak + shift,
                                rest_bytes=measured.rest_bytes + rest, rest_running=measured.rest_running + rest))


def wrap_plan(chosen: Plan, preserve_rng_state: bool = True, regrouped: tuple[str, ...] = ()) -> WrapPlan:
    """``chosen`` as a plan the engine installs: each layer with its option (``keep`` stays unwrapped).

    A part (``inside.py``) is just another module name: wrapped on its own, or
    inside its wrapped layer (nested checkpoints); an ``inside`` layer stays unwrapped.
    ``regrouped``: the layers profiled with op groups (``Profile.regrouped``); those
    with a part in the plan run as op groups (``WrapPlan.regroup``), their parts being groups.

    The planner decides and never installs; the names keep ``chosen``'s order.
    """
    how = {option: treatment(option, preserve_rng_state) for option in set(chosen.choices.values())}  # one each
    groups = tuple(EachLayer((name,), how[option]) for name, option in chosen.choices.items() if how[option] is not None)
    return WrapPlan(groups, summary=f"ckpt=auto plan:\n{chosen}", planned=chosen,
                    regroup=_regrouped(regrouped, chosen.choices))


def _regrouped(regrouped: tuple[str, ...], choices: Mapping[str, Option]) -> tuple[str, ...]:
    """The layers of ``regrouped`` that run as op groups under ``choices``: those with a part in it. The
    others run their own forward, as their own options were measured (a traced forward may free sooner)."""
    return tuple(layer for layer in regrouped if any(n.startswith(f"{layer}.") for n in choices))


def chain_costs(model: nn.Module, names: list[str], forward: Callable[[], Any], *,
                fake: bool = True) -> tuple[ChainCosts, int]:
    """What ``planning/rotor.py`` plans a chain of ``names`` (in the order they run) with, and the act peak without.

    Two steps on fake tensors (``fake=False``: real ones, for tests): memory
    with every layer as it is and with every layer checkpointed alone, which
    splits into its forward inside a region and its recomputation as a region's
    last layer, and the FLOPs the second counts (forward and recomputed).
    """
    names = list(dict.fromkeys(names))
    check_candidates(model, names)

    def measured() -> tuple[Recorder, Recorder]:
        with (cache_warnings_silenced(), checkpointing_disabled(model),
              fake_measurement(model, "ckpt.segments=optimal's profile") as mode):
            mode = mode if fake else None
            return (recorded_step(model, names, forward, KEEP, fake=mode),
                    recorded_step(model, names, forward, FULL, fake=mode))

    plain, alone = with_values_replayed(model, forward, measured) if fake else measured()
    counted = alone
    kept, running, peak = plain.analyse()
    inputs = alone.analyse()[0]  # checkpointed, a layer keeps its inputs only
    phase = alone.phase_running
    costs = ChainCosts(
        input_bytes=tuple(inputs.get(n, 0) for n in names),
        kept_bytes=tuple(max(kept.get(n, 0) - inputs.get(n, 0), 0) for n in names),
        running_bytes=tuple(running.get(n, 0) for n in names),
        region_running_bytes=tuple(phase.get((n, "forward"), 0) for n in names),
        last_running_bytes=tuple(phase.get((n, "recompute"), 0) for n in names),
        flops=tuple(counted.forward_flops.get(n, 0) for n in names),
        last_flops=tuple(counted.flops.get(n, 0) for n in names),
        after_running=running.get(REST, 0),
        backward_bytes=plain.backward_held,
    )
    return costs, peak


__all__ = [
    "chain_costs",
    "Cost",
    "INSIDE_DEPTH",
    "LayerProfile",
    "OPTIONS",
    "Plan",
    "Profile",
    "ProfileCache",
    "with_times",
    "wrap_plan",
    "profile",
    "treatment",
]
