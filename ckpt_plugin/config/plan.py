"""One config becomes one plan; one function installs it. Every mode, ``auto`` included.

    plan = plan_for(model, make_config(layers="TransformerBlock"))   # WrapPlan: what and how
    install(model, plan)                                            # the engine puts it on

:func:`plan_for` is the only place that reads a validated ``ckpt`` config and
decides what the engine does: which modules (``engine/selection.py``), how
each call runs (an ``engine.treatment.Treatment``), one checkpoint per layer or
segments over a chain, or, for ``ckpt=auto``, what the planner chose from a
profile, and for ``ckpt.segments=optimal`` the schedule ``planning/rotor.py``
finds for ``ckpt.budget`` from the chain's costs. It dispatches on the config's
type. Nothing here touches the model; :func:`apply_config` is
``install(model, plan_for(...))``.

Segments are checked here, when they are asked for, not at the first step
(issue #20): where the layers sit (``engine.chain_check.check_chain``), then,
when there is a sample input (``forward``, or the model's
``example_input_array``), what they get in one forward of it on fake tensors:
the very check every call of the chain goes through (``chain_check.Links``),
on every layer. Without a sample, that check waits for the first step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from ckpt_plugin._compat import compiled_by_user, user_module
from ckpt_plugin.config.schema import (AutoConfig, CkptConfig, FullConfig, NoneConfig, OffloadConfig, SelectiveConfig,
                                       make_config)
from ckpt_plugin.engine import deepspeed as deepspeed_checkpoint
from ckpt_plugin.engine.chain_check import call_problem, watching
from ckpt_plugin.engine.plan import EachLayer, Segments, WrapPlan
from ckpt_plugin.engine.policies import make_policy
from ckpt_plugin.config.values import DEFAULT_BACKEND, backend_of
from ckpt_plugin.engine.sequential import regions
from ckpt_plugin.engine.selection import resolve_layers, select_layers
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import check_plan, checkpointing_disabled, install, policy_of
from ckpt_plugin.errors import ConfigError, Problem, raise_problems
from ckpt_plugin.config.in_the_way import least_lines, with_floor, with_reasons
from ckpt_plugin.measure.fake import on_fake_tensors
from ckpt_plugin.units import format_bytes
from ckpt_plugin.measure.sample import example_forward, scalar
from ckpt_plugin.config.budget import parse_budget, resolve
from ckpt_plugin.planning.plan_file import load_plan
from ckpt_plugin.planning.planner import OPTIONS, Profile, smallest_peak
from ckpt_plugin.planning.profile import INSIDE_DEPTH, ProfileCache, chain_costs, profile, wrap_plan
from ckpt_plugin.planning.rotor import Unreachable, least_peak, simulate, solve

log = logging.getLogger("ckpt_plugin")


def treatment_of(config: CkptConfig) -> Treatment:
    """How every call of a layer selected by ``config`` runs (not for ``none`` or ``auto``)."""
    if isinstance(config, OffloadConfig):
        return Treatment(checkpointing=False, offload=True)
    policy = None
    if isinstance(config, SelectiveConfig):
        policy = make_policy(config.policy, save_names=config.save_names, exclude_names=config.exclude_names)
    deepspeed = getattr(config, "deepspeed", None)
    return Treatment(
        checkpointing=True,
        preserve_rng_state=config.preserve_rng_state,
        policy=policy,
        offload=config.offload,
        checkpoint_fn=deepspeed_checkpoint.checkpointed_call if deepspeed is not None else None,
        check_recompute=config.check_recompute,
    )


def plan_for(model: nn.Module, config: CkptConfig, forward: Callable[[], Any] | None = None) -> WrapPlan:
    """The plan ``config`` asks for on ``model``; raises, naming the keys, when it cannot be honoured.

    ``forward()`` runs the model on a sample input, for ``ckpt=auto``'s
    profile and the segments' chain check (on fake tensors); by default
    ``model(model.example_input_array)``, if it has one. ``model`` may be
    wrapped (compiled, DDP, FSDP, Fabric): the plan names the modules of the user's own module.
    """
    given, model = model, user_module(model)
    if isinstance(config, NoneConfig):
        return WrapPlan()
    if isinstance(config, AutoConfig) and config.plan is not None:
        return given_plan(model, config)
    layers, note = resolve_layers(model, config.layers)
    note = note or ""
    names = select_layers(model, layers, config.every_n)
    if isinstance(config, AutoConfig):
        return _auto(given, model, config, names, forward or _sample_forward(model), note)
    segments = getattr(config, "segments", None)
    if segments is None:
        backend = backend_of(config.compile)
        summary = "\n".join(filter(None, [note, _compiled_line(config, backend, len(names))]))
        return WrapPlan((EachLayer(tuple(names), treatment_of(config), compile=backend),), summary=summary, note=note)
    if config.every_n != 1:
        raise_problems([Problem(
            "ckpt.segments",
            f"ckpt.segments={segments} cannot be combined with ckpt.every_n={config.every_n}: "
            "segments group consecutive layers", "drop one of the two")])
    optimal = segments == "optimal"  # planned below, once the layers are known to be a chain
    group = Segments(tuple(names), 1 if optimal else segments, treatment_of(config))
    plan = WrapPlan((group,), summary=note, note=note)
    check_plan(model, plan)  # where the layers sit, first: nothing runs for layers that cannot be a chain
    if optimal:
        forward = forward or _sample_forward(model, "ckpt.segments", "ckpt.segments=optimal")
    elif forward is None and getattr(model, "example_input_array", None) is not None:
        forward = example_forward(model)
    if forward is not None:
        raise_problems(chain_problems(model, names, forward), "ckpt.segments")
    return _optimal(model, config, names, forward, note) if optimal else plan


def given_plan(model: nn.Module, config: AutoConfig) -> WrapPlan:
    """``ckpt.plan``: the file's plan, checked against ``model``, installed as it is: nothing is profiled or timed."""
    plan = load_plan(config.plan, model)
    ignored = [f"ckpt.{k}={v}" for k, v in (("layers", config.layers), ("budget", config.budget)) if v is not None]
    lines = [f"ckpt.plan: installing the plan in {config.plan} as it is, without planning ({len(plan.names)} "
             f"module(s))" + (f"; {', '.join(ignored)} not read: the plan decides" if ignored else ""),
             str(plan.planned) if plan.planned is not None else ""]
    return replace(plan, summary="\n".join(filter(None, [plan.note, *lines])))


def _auto(given: nn.Module, model: nn.Module, config: AutoConfig, names: list[str], forward: Callable[[], Any],
          note: str) -> WrapPlan:
    """``ckpt=auto``: the planner's choice per layer for ``ckpt.budget``, measured as the step will run.

    Below what one option per layer reaches, the layers' parts become candidates
    too (``inside.py``): measured only then, as they double the profile's cost;
    below that, nested regions over the layers, if they form a chain
    (:func:`_chain_instead`). ``ckpt.budget=min`` goes down all three at once
    and takes the least peak of them. Parts and regions are planned for eager
    steps only.
    """
    budget = parse_budget(config.budget)
    backend = backend_of(config.compile)
    compiled = timed_compiled(config, backend, compiled_by_user(given, names))
    eager = not compiled and backend is None
    once = ProfileCache()  # the layers are stepped and timed once, should their parts be measured below

    def measured_to(depth: int) -> Profile:
        return profile(model, names, lambda: scalar(forward()), timed=True, compiled=compiled, depth=depth, cache=once)

    measured = measured_to(INSIDE_DEPTH if budget.least and eager else 0)
    in_the_way = ""  # ckpt.budget=min, eager: how low any plan could go, and what stands in the way
    if budget.least:
        chosen = measured.least()
        regions_plan = _chain_instead(model, config, names, forward, note, measured,
                                      below=chosen.predicted_peak) if eager else None
        in_the_way = least_lines(model, names, lambda: scalar(forward()), measured.no_ckpt_peak) if eager else ""
        if regions_plan is not None:
            return replace(regions_plan, summary="\n".join(filter(None, [regions_plan.summary, in_the_way])))
    else:
        try:
            chosen = _fitting(measured, resolve(budget, measured.no_ckpt_peak))
        except ConfigError:
            if not eager:
                raise
            measured = measured_to(INSIDE_DEPTH)
            try:
                chosen = _fitting(measured, resolve(budget, measured.no_ckpt_peak))
            except ConfigError as err:
                try:
                    return _chain_instead(model, config, names, forward, note, measured,
                                          below=smallest_peak(measured.layers, measured.rest_running), refused=err)
                except ConfigError as refused:
                    raise with_reasons(refused, model, names, lambda: scalar(forward()),
                                       resolve(budget, measured.no_ckpt_peak), measured.no_ckpt_peak) from refused
    plan = wrap_plan(chosen, config.preserve_rng_state, measured.regrouped)
    summary = plan.summary
    if budget.least:
        least = (f"ckpt.budget=min: the least activation peak reachable by one option per layer"
                 f"{' or parts of it' if eager else ''} is {format_bytes(chosen.predicted_peak)} "
                 f"({chosen.predicted_peak / measured.no_ckpt_peak:.2f} of the peak without checkpointing)")
        summary = "\n".join(filter(None, [least, in_the_way, summary]))
    if not plan.names:  # not silent: a budget above the peak is why nothing is wrapped
        summary += (f"\nckpt.budget={config.budget} is at least the activation peak without checkpointing "
                    f"({format_bytes(measured.no_ckpt_peak)}): every layer is kept, none is wrapped")
    if backend is not None and plan.names:
        plan = replace(plan, groups=tuple(replace(g, compile=backend) for g in plan.groups))
        summary += (f"\nckpt.compile: the {len(plan.names)} layer(s) this plan wraps run compiled ({backend}), "
                    "the kept ones eagerly; the plan's peak was measured uncompiled (fake tensors)")
    return replace(plan, summary="\n".join(filter(None, [note, summary])), note=note)


def _optimal(model: nn.Module, config: FullConfig, names: list[str], forward: Callable[[], Any],
             note: str) -> WrapPlan:
    """``ckpt.segments=optimal``: Rotor's schedule for ``ckpt.budget``, from the layers' costs on fake tensors.

    The cost is recomputed FLOPs (exact: no timing). A budget at least the measured peak
    without checkpointing wraps nothing, as for ckpt=auto; one below the least peak any
    schedule reaches is refused with that least peak.
    """
    costs, none_peak = chain_costs(model, names, lambda: scalar(forward()))
    budget = parse_budget(config.budget)
    limit = least_peak(costs) if budget.least else resolve(budget, none_peak)
    if limit >= none_peak:  # nothing checkpointed fits, as measured, whatever the model says (as for ckpt=auto)
        limit = max(limit, simulate(costs, range(len(names)))[0])
    try:
        solution = solve(costs, limit, names)
    except Unreachable as err:
        refused = ConfigError([Problem("ckpt.budget", _unreachable(limit, err.least, none_peak))])
        raise with_floor(refused, model, lambda: scalar(forward()), limit, none_peak) from err
    against = (f"ckpt.segments=optimal over the {len(names)} layers {names[0]} .. {names[-1]} for ckpt.budget="
               f"{config.budget} ({format_bytes(limit)}; the activation peak without checkpointing is "
               f"{format_bytes(none_peak)})")
    if not regions(solution.schedule):  # not silent: the budget is why nothing is wrapped
        lines = [against, (f"ckpt.budget={config.budget} fits the step without checkpointing (predicted peak "
                           f"{format_bytes(solution.predicted_peak)}): every layer runs as it is, none is wrapped")]
        return WrapPlan(summary="\n".join(filter(None, [note, *lines])), planned=solution, note=note)
    lines = [against, str(solution)]
    if sum(costs.flops):
        lines[-1] += f" ({solution.recompute_flops / sum(costs.flops):.2f} of one forward of the layers)"
    group = Segments(tuple(names), solution.schedule, treatment_of(config))
    return WrapPlan((group,), summary="\n".join(filter(None, [note, *lines])), planned=solution, note=note)


def _chain_instead(model: nn.Module, config: AutoConfig, names: list[str], forward: Callable[[], Any], note: str,
                   measured: Profile, *, below: int, refused: ConfigError | None = None) -> WrapPlan | None:
    """``ckpt=auto`` below ``below``, the least peak of one option per layer: Rotor's schedule over the layers,
    if they form a chain (checked where they sit and on the sample, as ``ckpt.segments`` is) and it fits the budget.

    ``refused``: why the per-layer plans did not fit, raised again where regions do not
    fit either or the layers form no chain; without it (``ckpt.budget=min``) the least
    peak of the regions, or None where they reach no lower than ``below``.
    Nested regions recompute more FLOPs than any per-layer plan that fits, so they are
    only the answer where none fits; their cost is recomputed FLOPs (``rotor.py``). Eager
    steps only: a region spans several layers' calls, opened and closed by hooks, which
    ``torch.compile`` cannot capture as one graph (nor ``ckpt.compile`` compile as one call).
    """
    full = Treatment(checkpointing=True, preserve_rng_state=config.preserve_rng_state)
    try:
        check_plan(model, WrapPlan((Segments(tuple(names), 1, full),)))
        problems = chain_problems(model, names, forward)
    except ConfigError:
        problems = True
    if problems:
        if refused is not None:
            raise refused from None
        return None
    costs, none_peak = chain_costs(model, names, lambda: scalar(forward()))
    limit = least_peak(costs) if refused is None else resolve(parse_budget(config.budget), none_peak)
    if refused is None and limit >= below:
        return None
    try:
        solution = solve(costs, limit, names)
    except Unreachable as err:
        if err.least >= below:
            raise refused from None  # its least peak is the least of the two
        raise ConfigError([Problem("ckpt.budget", _unreachable(
            limit, err.least, none_peak, "ckpt=auto", "of regions nested over the chain, below any one option per layer"))]) from err
    short = (f"reaches {format_bytes(limit)} (ckpt.budget=min), as nested regions do" if refused is None else
             f"fits ckpt.budget={config.budget} ({format_bytes(limit)})")
    lines = [f"ckpt=auto: no choice per layer (keep, selective, full, or parts of it) {short}; the {len(names)} "
             "layers form a chain, so it nests checkpointed regions over them: Rotor's schedule, the least "
             "recomputed FLOPs that fit", str(solution)]
    group = Segments(tuple(names), solution.schedule, full)
    return WrapPlan((group,), summary="\n".join(filter(None, [note, *lines])), planned=solution, note=note)


def _unreachable(budget: int, least: int, reference: int, by: str = "ckpt.segments=optimal",
                 reaching: str = "any schedule of the chain") -> str:
    """Why ``budget`` bytes cannot be met ``by`` a mode: the least peak, as a budget that can be typed back."""
    fraction = math.ceil(least / reference * 100) / 100
    if int(fraction * reference) < least:  # the float's rounding, not the user's
        fraction += 0.01
    return (f"ckpt.budget: {budget} bytes ({format_bytes(budget)}, {budget / reference:.2f} of the activation peak "
            f"without checkpointing, {format_bytes(reference)}) cannot be met by {by}: the least peak {reaching} "
            f"reaches is {least} bytes ({format_bytes(least)}, {least / reference:.2f}); raise ckpt.budget to at "
            f"least {min(fraction, 1):g} or {least}B")


WRAPPING = tuple(o for o in OPTIONS if o != "keep")  # the options that wrap a layer (ckpt.compile compiles them)


def timed_compiled(config: AutoConfig, backend: str | None, user_compiled: bool) -> dict[str, str]:
    """Which options ``ckpt=auto`` times compiled, through which backend (option -> backend).

    As the step will run them: ``ckpt.compile`` runs the layers the plan wraps
    compiled and the kept ones eagerly; a model or layers the user compiled
    run every option compiled. ``ckpt.timing`` overrides: ``eager``, or
    ``compiled`` (inductor, torch.compile's default) or a backend for every option.
    """
    timing = config.timing
    if timing == "eager":
        return {}
    if timing == "auto":
        if user_compiled:
            timing = backend or DEFAULT_BACKEND
        elif backend is not None:
            return dict.fromkeys(WRAPPING, backend)
        else:
            return {}
    chosen = DEFAULT_BACKEND if timing == "compiled" else timing
    if backend is not None and not user_compiled:  # ckpt.compile: the kept layers stay eager
        return dict.fromkeys(WRAPPING, chosen)
    return dict.fromkeys(OPTIONS, chosen)


def _compiled_line(config: CkptConfig, backend: str | None, n: int) -> str:
    """What the plan's summary says of ``ckpt.compile`` ("" when off)."""
    if backend is None:
        return ""
    what = "" if isinstance(config, OffloadConfig) else ", its checkpoint included"
    return f"ckpt.compile: each of the {n} wrapped layer(s) runs compiled ({backend}){what}; compiled at its first call"


def chain_problems(model: nn.Module, names: list[str], forward: Callable[[], Any]) -> list[Problem]:
    """Whether ``names`` run as a chain in ``forward()``, run once on fake tensors: the first break, or none.

    Each call is checked as the chain checks its calls in training (``chain_check.Links``),
    the arguments as a checkpointed training call gets them. The model runs as it
    is unwrapped, leaving no trace (buffers, RNG, ``.grad``). A forward that cannot
    run on fake tensors, or fails for any reason of its own before a layer breaks
    the chain, decides nothing: the calls are then checked at the first step, as without a sample.
    """
    breaks: list[tuple[int, str]] = []
    try:
        with (checkpointing_disabled(model), watching(model, names) as breaks,
              on_fake_tensors(model, "ckpt.segments' chain check")):
            forward()
    except Exception as err:  # noqa: BLE001 -- the step itself will report its own error
        if not breaks:
            log.debug("ckpt.segments: the chain is checked at the first step (the sample forward failed: %s)", err)
    return [call_problem(model, names, breaks)] if breaks else []


def _sample_forward(model: nn.Module, key: str = "ckpt.mode", who: str = "ckpt=auto") -> Callable[[], Any]:
    """``model(example_input_array)``; a model without one is the user's to fix, so a ConfigError."""
    if getattr(model, "example_input_array", None) is None:
        raise_problems([Problem(
            key,
            f"{who} profiles the layers on a sample input: set `example_input_array` on {type(model).__name__} "
            "(Lightning's convention: a tensor, a tuple of arguments or a dict)",
            "or choose another ckpt preset (under Lightning's callback, the call training_step makes with the first "
            "training batch serves too)",
        )])
    return example_forward(model)


def _fitting(measured: Any, budget_bytes: int) -> Any:
    """The planner's choice for ``budget_bytes``; a budget no choice meets is the user's to change."""
    try:
        return measured.plan(budget_bytes)
    except ConfigError:
        raise
    except ValueError as err:  # planning/planner.py words "cannot be met" (and the smallest peak) as a ValueError
        raise ConfigError([Problem("ckpt.budget", str(err))]) from err


def apply_config(model: nn.Module, config: CkptConfig, forward: Callable[[], Any] | None = None) -> list[str]:
    """Plan ``config`` on ``model`` and install the plan; returns the qualified names wrapped.

    With ``ckpt.policy=names``, the first backward checks the names, as the
    Lightning callback does after its first step and ``checkpoint()`` after its
    first call: a name in ``ckpt.save_names``/``exclude_names`` that no
    ``checkpoint_name`` used would otherwise save nothing, silently.
    """
    plan = plan_for(model, config, forward)
    names = install(model, plan)
    if plan.summary:
        log.info(plan.summary)
    policy = policy_of(user_module(model))
    if policy is not None and policy.uses_names:
        policy.check_in_backward = True  # nothing on the model: remove_checkpointing leaves it as it was
    return names


def apply_checkpointing(model: nn.Module, **ckpt_keys: Any) -> list[str]:
    """Checkpoint the layers of ``model`` named by the keys of the ``ckpt`` node.

    >>> apply_checkpointing(gpt, layers="TransformerBlock")
    ['blocks.0', 'blocks.1', ...]

    Returns the qualified names wrapped, in model order. Applying again replaces
    the previous wrapping (never wraps twice); ``mode="none"`` unwraps.
    ``mode="auto", plan="ckpt_plan.json"`` installs a saved plan (``planning/plan_file.py``)
    without planning; ``planning.plan_file.save_plan(plan_for(...), path, model)`` writes one.
    """
    return apply_config(model, make_config(**ckpt_keys))


__all__ = ["apply_checkpointing", "apply_config", "chain_problems", "given_plan", "plan_for", "treatment_of"]
