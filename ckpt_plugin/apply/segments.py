"""Regions over a chain of layers, planned: the chain check on a sample, ``ckpt.segments=optimal``'s schedule, and
``ckpt=auto``'s nested regions where no choice per layer fits.

Segments are checked when they are asked for, not at the first step (issue #20):
where the layers sit (``engine.chain_check.check_chain``), then, when there is a
sample input, what they get in one forward of it on fake tensors: the very check
every call of the chain goes through (``chain_check.Links``), on every layer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from torch import nn

from ckpt_plugin.apply.diagnose import with_floor
from ckpt_plugin.apply.treatment import treatment_of
from ckpt_plugin.config.budget import parse_budget, resolve
from ckpt_plugin.config.schema import AutoConfig, FullConfig
from ckpt_plugin.engine.chain_check import call_problem, watching
from ckpt_plugin.engine.plan import Segments, WrapPlan
from ckpt_plugin.engine.sequential import regions
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import check_plan, checkpointing_disabled
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.measure.fake import on_fake_tensors
from ckpt_plugin.measure.sample import scalar
from ckpt_plugin.planning.planner import Profile
from ckpt_plugin.planning.profile import chain_costs
from ckpt_plugin.planning.rotor import Unreachable, least_peak, simulate, solve
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
    budget = parse_budget(config.budget)
    limit = least_peak(costs) if budget.least else resolve(budget, none_peak)
    if limit >= none_peak:  # nothing checkpointed fits, as measured, whatever the model says (as for ckpt=auto)
        limit = max(limit, simulate(costs, range(len(names)))[0])
    try:
        solution = solve(costs, limit, names)
    except Unreachable as err:
        refused = ConfigError([Problem("ckpt.budget", unreachable(limit, err.least, none_peak))])
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


def chain_instead(model: nn.Module, config: AutoConfig, names: list[str], forward: Callable[[], Any], note: str,
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
        raise ConfigError([Problem("ckpt.budget", unreachable(
            limit, err.least, none_peak, "ckpt=auto", "of regions nested over the chain, below any one option per layer"))]) from err
    short = (f"reaches {format_bytes(limit)} (ckpt.budget=min), as nested regions do" if refused is None else
             f"fits ckpt.budget={config.budget} ({format_bytes(limit)})")
    lines = [f"ckpt=auto: no choice per layer (keep, selective, full, or parts of it) {short}; the {len(names)} "
             "layers form a chain, so it nests checkpointed regions over them: Rotor's schedule, the least "
             "recomputed FLOPs that fit", str(solution)]
    group = Segments(tuple(names), solution.schedule, full)
    return WrapPlan((group,), summary="\n".join(filter(None, [note, *lines])), planned=solution, note=note)


def unreachable(budget: int, least: int, reference: int, by: str = "ckpt.segments=optimal",
                 reaching: str = "any schedule of the chain") -> str:
    """Why ``budget`` bytes cannot be met ``by`` a mode: the least peak, as a budget that can be typed back."""
    fraction = math.ceil(least / reference * 100) / 100
    if int(fraction * reference) < least:  # the float's rounding, not the user's
        fraction += 0.01
    return (f"ckpt.budget: {budget} bytes ({format_bytes(budget)}, {budget / reference:.2f} of the activation peak "
            f"without checkpointing, {format_bytes(reference)}) cannot be met by {by}: the least peak {reaching} "
            f"reaches is {least} bytes ({format_bytes(least)}, {least / reference:.2f}); raise ckpt.budget to at "
            f"least {min(fraction, 1):g} or {least}B")


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


__all__ = ["chain_instead", "chain_problems", "optimal_plan", "unreachable"]
