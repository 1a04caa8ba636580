"""Regions over a chain of layers, planned: ``ckpt.segments=optimal``'s schedule, and the chain check on a sample
(which ``ckpt=auto``'s nested regions, ``strategies.NestedRegions``, go through too).

Segments are checked when they are asked for, not at the first step (issue #20):
where the layers sit (``engine.segments.chain_check.check_chain``), then, when there is a
sample input, what they get in one forward of it on fake tensors: the very check
every call of the chain goes through (``chain_check.Links``), on every layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from ckpt_plugin.apply.diagnose import with_floor
from ckpt_plugin.apply.treatment import treatment_of
from ckpt_plugin.config.budget import cannot_meet, resolve
from ckpt_plugin.config.schema import FullConfig
from ckpt_plugin.engine.segments.chain_check import call_problem, watching
from ckpt_plugin.engine.plan import Segments, WrapPlan
from ckpt_plugin.engine.segments.sequential import regions
from ckpt_plugin.engine.wrap import checkpointing_disabled
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.measure.fake import on_fake_tensors
from ckpt_plugin.measure.sample import scalar
from ckpt_plugin.planning.nofit import NoFit
from ckpt_plugin.planning.profile import chain_costs
from ckpt_plugin.planning.rotor import fit, least_peak, simulate
from ckpt_plugin.units import format_bytes

log = logging.getLogger("ckpt_plugin")


def optimal_plan(model: nn.Module, config: FullConfig, names: list[str], forward: Callable[[], Any],
             note: str) -> WrapPlan:
    """``ckpt.segments=optimal``: Rotor's schedule for ``ckpt.budget``, from the layers' costs on fake tensors.

    The cost is recomputed FLOPs (exact: no timing). A budget at least the measured peak
    without checkpointing wraps nothing, as for ckpt=auto; one below the least peak any
    schedule reaches is refused with that least peak.
    """
    costs, none_peak = chain_costs(model, names, lambda: scalar(forward()))
    budget = config.read_budget
    limit = least_peak(costs) if budget.least else resolve(budget, none_peak)
    if limit >= none_peak:  # nothing checkpointed fits, as measured, whatever the model says (as for ckpt=auto)
        limit = max(limit, simulate(costs, range(len(names)))[0])
    solution = fit(costs, limit, names)
    if isinstance(solution, NoFit):
        refused = ConfigError([cannot_meet(limit, solution.least, none_peak, by="ckpt.segments=optimal",
                                           reaching="any schedule of the chain reaches")])
        raise with_floor(refused, model, lambda: scalar(forward()), limit, none_peak)
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


__all__ = ["chain_problems", "optimal_plan"]
