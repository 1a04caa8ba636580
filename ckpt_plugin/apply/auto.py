"""``ckpt=auto``: the plan of the first strategy that fits ``ckpt.budget`` (``strategies.py``), measured as the step
will run, and what its summary says; or a saved plan (``ckpt.plan``), installed as it is."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import compiled_by_user
from ckpt_plugin.apply.diagnose import least_lines, with_reasons
from ckpt_plugin.apply.memory import ModuleSteps, WholeSteps, fit_memory, least_plan
from ckpt_plugin.apply.strategies import (
    Chosen,
    Measuring,
    NestedRegions,
    first_fit,
    least_of,
    strategies,
)
from ckpt_plugin.config.budget import Budget, resolve
from ckpt_plugin.config.memory import resolve_memory
from ckpt_plugin.config.schema import AutoConfig
from ckpt_plugin.config.values import DEFAULT_BACKEND, backend_of
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.whole_step import Held
from ckpt_plugin.planning.options import OPTIONS, Option
from ckpt_plugin.planning.plan_file import load_plan
from ckpt_plugin.planning.profile import INSIDE_DEPTH
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
              note: str, optimizers: Sequence[torch.optim.Optimizer] = (),
              timing_forward: Callable[[], Any] | None = None, step: Callable[[], Any] | None = None,
              held: Sequence[Held] = (), steps: WholeSteps | None = None, chains: bool = True) -> WrapPlan:
    """``ckpt=auto``: the first of ``strategies.py``'s strategies whose plan fits ``ckpt.budget``, measured as the
    step will run (``ckpt.budget=min``: the lowest of them); the refusal of the one that reaches lowest where none
    fits, with what stands in the way (eager steps: ``diagnose.py``). ``ckpt.memory``: the fastest plan whose whole
    step, ``optimizers`` stepping, fits (``memory.py``). ``timing_forward``: the forward the options are timed on
    (``ckpt.batch=max``: the batch the loader had, never the larger one planned for), ``forward`` by default;
    ``step``: what ``ckpt.memory``'s whole step runs to its loss (the callback: ``training_step``), ``forward``
    by default; ``held``: what the device holds beside the step (the batch, DDP's buckets); ``steps``: how the
    whole step is measured, where not on ``model`` with ``step``, ``optimizers`` and ``held`` (under FSDP: a
    fake twin, sharded); ``chains``: False where regions over several layers cannot be (``strategies.Measuring``)."""
    budget = config.read_budget
    backend = backend_of(config.compile)
    compiled = timed_compiled(config, backend, compiled_by_user(given, names))
    eager = not compiled and backend is None
    measuring = Measuring(model, names, forward, compiled, config.preserve_rng_state, timing_forward, chains=chains,
                          offload=config.offload)
    tried = strategies(measuring, eager)
    if config.read_memory is not None:
        steps = steps or ModuleSteps(model, lambda rows: step or forward, optimizers, lambda rows: held)
        limit = resolve_memory(config.read_memory, steps.device or next(model.parameters()).device)
        least = least_plan(measuring, eager) if eager else None  # compiled: bytes as timed compiled
        chosen, fit = fit_memory(tried, limit, steps.of, least=least)
        budget = Budget(bytes=fit.activation_budget)
        made = (_regions(chosen, config, budget, names, note, "") if isinstance(chosen.strategy, NestedRegions)
                else _per_layer(chosen, config, budget, backend, eager, note, ""))
        lines = fit.lines(str(config.memory)) + ([] if optimizers or not isinstance(steps, ModuleSteps) else [
            "  no optimizer was given: its state is not counted (the callback steps the Trainer's optimizers)"])
        return replace(made, summary="\n".join([*lines, made.summary]), fit=fit)
    if budget.least:
        chosen = least_of(tried)
    else:
        chosen = first_fit(tried, budget)
        if isinstance(chosen, ConfigError):
            if not eager:
                raise chosen
            reference = tried[0].reference
            raise with_reasons(chosen, model, names, measuring.run, resolve(budget, reference), reference)
    in_the_way = ""  # ckpt.budget=min, eager: how low any plan could go, and what stands in the way
    if budget.least and eager:
        in_the_way = least_lines(model, names, measuring.run, measuring.profile(INSIDE_DEPTH).no_ckpt_peak)
    if isinstance(chosen.strategy, NestedRegions):
        return _regions(chosen, config, budget, names, note, in_the_way)
    return _per_layer(chosen, config, budget, backend, eager, note, in_the_way)


def _per_layer(chosen: Chosen, config: AutoConfig, budget: Budget, backend: str | None, eager: bool, note: str,
               in_the_way: str) -> WrapPlan:
    """The WrapPlan of a per-layer choice, and its summary: the plan's table, what min reached, what compiles."""
    strategy, measured = chosen.strategy, chosen.strategy.measured
    plan = strategy.installed(chosen.plan)
    summary = plan.summary
    if budget.least:
        peak = chosen.plan.predicted_peak
        least = (f"ckpt.budget=min: the least activation peak reachable by one option per layer"
                 f"{' or parts of it' if eager else ''} is {format_bytes(peak)} "
                 f"({peak / measured.no_ckpt_peak:.2f} of the peak without checkpointing)")
        summary = "\n".join(filter(None, [least, in_the_way, summary]))
    if not plan.names and config.read_memory is not None:  # not silent: the limit holds the step as it is
        summary += (f"\nckpt.memory={config.memory} holds the whole step without checkpointing: every layer is "
                    "kept, none is wrapped")
    elif not plan.names:  # not silent: a budget above the peak is why nothing is wrapped
        summary += (f"\nckpt.budget={config.budget} is at least the activation peak without checkpointing "
                    f"({format_bytes(measured.no_ckpt_peak)}): every layer is kept, none is wrapped")
    if backend is not None and plan.names:
        plan = replace(plan, groups=tuple(replace(g, compile=backend) for g in plan.groups))
        summary += (f"\nckpt.compile: the {len(plan.names)} layer(s) this plan wraps run compiled ({backend}), "
                    "the kept ones eagerly; the plan's peak was measured uncompiled (fake tensors)")
    return replace(plan, summary="\n".join(filter(None, [note, summary])), note=note)


def _regions(chosen: Chosen, config: AutoConfig, budget: Budget, names: list[str], note: str,
             in_the_way: str) -> WrapPlan:
    """The WrapPlan of Rotor's schedule where no choice per layer fits (or, for min, reaches as low)."""
    solution = chosen.plan
    short = (f"reaches {format_bytes(solution.limit)} (ckpt.budget=min), as nested regions do" if budget.least else
             f"fits ckpt.budget={config.budget} ({format_bytes(solution.limit)})")
    lines = [f"ckpt=auto: no choice per layer (keep, selective, full, or parts of it) {short}; the {len(names)} "
             "layers form a chain, so it nests checkpointed regions over them: Rotor's schedule, the least "
             "recomputed FLOPs that fit", str(solution), in_the_way]
    plan = chosen.strategy.installed(solution)
    return replace(plan, summary="\n".join(filter(None, [note, *lines])), note=note)


WRAPPING = tuple(o for o in OPTIONS if o.checkpoints)  # the options that wrap a layer (ckpt.compile compiles them)


def timed_compiled(config: AutoConfig, backend: str | None, user_compiled: bool) -> dict[Option, str]:
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


__all__ = ["WRAPPING", "auto_plan", "given_plan", "timed_compiled"]
