"""``ckpt=auto``: the planner's choice per layer for ``ckpt.budget``, measured as the step will run; or a saved plan.

Below what one option per layer reaches, the layers' parts become candidates too
(``planning/inside.py``); below that, nested regions over the layers, if they form
a chain (``segments.chain_instead``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from ckpt_plugin._compat import compiled_by_user
from ckpt_plugin.apply.diagnose import least_lines, with_reasons
from ckpt_plugin.apply.segments import chain_instead
from ckpt_plugin.config.budget import parse_budget, resolve
from ckpt_plugin.config.schema import AutoConfig
from ckpt_plugin.config.values import DEFAULT_BACKEND, backend_of
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.measure.sample import scalar
from ckpt_plugin.planning.plan_file import load_plan
from ckpt_plugin.planning.planner import OPTIONS, Profile, smallest_peak
from ckpt_plugin.planning.profile import INSIDE_DEPTH, ProfileCache, profile, wrap_plan
from ckpt_plugin.units import format_bytes


def given_plan(model: nn.Module, config: AutoConfig) -> WrapPlan:
    """``ckpt.plan``: the file's plan, checked against ``model``, installed as it is: nothing is profiled or timed."""
    plan = load_plan(config.plan, model)
    ignored = [f"ckpt.{k}={v}" for k, v in (("layers", config.layers), ("budget", config.budget)) if v is not None]
    lines = [f"ckpt.plan: installing the plan in {config.plan} as it is, without planning ({len(plan.names)} "
             f"module(s))" + (f"; {', '.join(ignored)} not read: the plan decides" if ignored else ""),
             str(plan.planned) if plan.planned is not None else ""]
    return replace(plan, summary="\n".join(filter(None, [plan.note, *lines])))


def auto_plan(given: nn.Module, model: nn.Module, config: AutoConfig, names: list[str], forward: Callable[[], Any],
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
        regions_plan = chain_instead(model, config, names, forward, note, measured,
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
                    return chain_instead(model, config, names, forward, note, measured,
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


def _fitting(measured: Any, budget_bytes: int) -> Any:
    """The planner's choice for ``budget_bytes``; a budget no choice meets is the user's to change."""
    try:
        return measured.plan(budget_bytes)
    except ConfigError:
        raise
    except ValueError as err:  # planning/planner.py words "cannot be met" (and the smallest peak) as a ValueError
        raise ConfigError([Problem("ckpt.budget", str(err))]) from err


__all__ = ["WRAPPING", "auto_plan", "given_plan", "timed_compiled"]
