"""``ckpt.memory``: the fastest plan whose *whole* step fits the device, not only its activations.

The planner (``planning/planner.py``, ``rotor.py``) answers an activation budget
with the fastest plan whose activation peak fits it. The whole step holds more:
parameters, the gradients (from the step before, in Lightning, while the forward
runs: ``measure/whole_step.py``), the optimizer's state and temporaries; and where
the step peaks moves as activations shrink. On a 246 M-parameter Llama (issue #34)
the whole step peaked at 1.97 GB under ``budget=0.5``, ``0.25`` and ``full`` alike:
past that point the peak is the end of backward, where the gradients are, so a
leaner plan only adds recomputation. So no activation budget can be derived from
the limit by subtraction; instead the activation budget is searched for:

1. nothing wrapped: its whole step (on fake tensors) fits, so nothing is checkpointed;
2. ``ckpt.budget=min``'s plan: its whole step does not fit, so nothing does: a
   ConfigError naming the least memory needed and what takes it;
3. between the two, bisection on the activation budget: each candidate is the
   planner's fastest plan for that budget, installed for a moment and its whole
   step measured on fake tensors; the plan of the largest activation budget whose
   whole step fits is chosen (the larger the budget, the less recomputation).

Each candidate costs two steps on fake tensors (``whole_step``) and no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from ckpt_plugin.apply.strategies import (
    Chosen,
    Measuring,
    Strategy,
    first_fit,
    least_of,
    strategies,
)
from ckpt_plugin.config.budget import Budget
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.engine.wrap import install, remove_checkpointing
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.measure.whole_step import Around, Held, StepSplit, whole_step
from ckpt_plugin.units import format_bytes

_BISECTIONS = 10  # candidates measured between the least plan and none, at most
_RESOLUTION = 200  # bisection stops within 1/_RESOLUTION of the activation peak without checkpointing


@dataclass(frozen=True)
class StepFit:
    """What ``ckpt.memory`` planned: the limit, the chosen plan's whole step and the one without checkpointing,
    both predicted on fake tensors, and the activation budget the plan was chosen at."""

    limit: int
    split: StepSplit  # the chosen plan's whole step
    without: StepSplit  # nothing wrapped
    activation_budget: int
    measured: int  # whole steps measured on fake tensors while planning

    def lines(self, what: str) -> list[str]:
        return [f"ckpt.memory={what} ({format_bytes(self.limit)}, {self.limit} B) for the whole step on one rank: "
                f"the fastest plan whose whole step fits ({self.measured} whole steps measured on fake tensors)",
                f"  predicted whole-step peak {self.split}",
                f"  without checkpointing: {self.without}"]


def whole_of(model: nn.Module, plan: WrapPlan, forward: Callable[[], Any],
             optimizers: Sequence[torch.optim.Optimizer], held: Sequence[Held] = (), *, fake: bool = True,
             moments: bool = False, around: Around | None = None) -> StepSplit:
    """The whole step of ``model`` with ``plan`` installed for the measurement (fake tensors), then removed;
    ``held``: what the device holds beside it (the batch, DDP's buckets). ``fake=False``: ``model``'s tensors
    are its own to step (real ones, or a fake twin's: ``lightning/fsdp.py``)."""
    with cache_warnings_silenced():
        install(model, plan)
        try:
            return whole_step(model, forward, optimizers, fake=fake, moments=moments, around=around).holding(held)
        finally:
            remove_checkpointing(model)


class WholeSteps(Protocol):
    """How ``ckpt.memory``'s whole step is measured with a plan installed, at a batch of ``rows`` samples (None:
    the sample's): :class:`ModuleSteps` on the module itself; under FSDP, on the fake twin the strategy shards as
    it will shard the module (``lightning/fsdp.py``)."""

    def of(self, plan: WrapPlan, rows: int | None = None) -> StepSplit: ...

    @property
    def device(self) -> torch.device | None:
        """The device the step runs on, which ``ckpt.memory=device`` (or a share) resolves against; None: where
        the module's parameters are."""


@dataclass(frozen=True)
class ModuleSteps:
    """The whole step of ``model`` itself, on fake tensors: ``loss(rows)`` is the step to its loss at ``rows``
    samples, ``held(rows)`` what the device holds beside it (the batch, DDP's buckets)."""

    model: nn.Module
    loss: Callable[[int | None], Callable[[], Any]]
    optimizers: Sequence[torch.optim.Optimizer] = ()
    held: Callable[[int | None], Sequence[Held]] = field(default=lambda rows: ())
    moments: bool = False  # the split's moments besides its peak (whole_step's), for a ZeRO rank's model
    around: Around | None = None  # open around its two steps (ZeRO-3's gathered parameters: apply/zero3_gather.py)

    def of(self, plan: WrapPlan, rows: int | None = None) -> StepSplit:
        return whole_of(self.model, plan, self.loss(rows), self.optimizers, self.held(rows), moments=self.moments,
                        around=self.around)

    @property
    def device(self) -> torch.device | None:
        return None


def fit_memory(tried: list[Strategy], limit: int, whole: Callable[[WrapPlan], StepSplit],
               limit_key: str = "ckpt.memory", least: Chosen | None = None) -> tuple[Chosen, StepFit]:
    """The plan of the largest activation budget whose whole step (``whole``: measured with a plan installed)
    fits ``limit`` bytes; a ConfigError where even ``ckpt.budget=min``'s plan does not fit.

    ``least``: that plan, chosen without timings (default: ``least_of(tried)``). Several plans reach the least
    activation peak, with other temporaries; timed, the cheapest of them would depend on the machine's noise,
    and so would a refusal. Chosen by FLOPs (``least_plan``), it is the same plan on every run.
    """
    reference = next(s for s in tried if s.available()).reference  # the activation peak without checkpointing
    measured: dict[Any, StepSplit] = {}

    def of(chosen: Chosen) -> StepSplit:
        plan = chosen.strategy.installed(chosen.plan)
        key = (tuple(plan.names), repr(plan.groups))
        if key not in measured:
            measured[key] = whole(plan)
        return measured[key]

    without = whole(WrapPlan())
    everything = _fit(tried, reference)
    if without.peak <= limit:
        return everything, StepFit(limit, without, without, reference, 1 + len(measured))
    least = least or least_of(tried)
    least_split = of(least)
    if least_split.peak > limit:
        raise ConfigError([too_small(limit, least_split, without, limit_key)])
    low, high, best = least.plan.predicted_peak, reference, (least, least_split, least.plan.predicted_peak)
    for _ in range(_BISECTIONS):
        if high - low <= max(reference // _RESOLUTION, 1):
            break
        middle = (low + high) // 2
        chosen = _fit(tried, middle)
        split = of(chosen)
        if split.peak <= limit:
            low, best = middle, (chosen, split, middle)
        else:
            high = middle
    chosen, split, budget = best
    return chosen, StepFit(limit, split, without, budget, 1 + len(measured))


def least_plan(measuring: Measuring, eager: bool) -> Chosen:
    """``ckpt.budget=min``'s plan, its ties broken by FLOPs, not by timings (``fit_memory``)."""
    # The same cache: the profile's steps on fake tensors are read back, not run again.
    return least_of(strategies(replace(measuring, timed=False, _profiles={}), eager))


def _fit(tried: list[Strategy], budget_bytes: int) -> Chosen:
    chosen = first_fit(tried, Budget(bytes=budget_bytes))
    if isinstance(chosen, ConfigError):  # below what ckpt.budget=min reached: the caller never asks
        raise chosen
    return chosen


def too_small(limit: int, least: StepSplit, without: StepSplit | None, key: str = "ckpt.memory",
              at: str = "") -> Problem:
    """The refusal of a limit the least plan's whole step exceeds: the least memory, what takes it, the fixes."""
    where = f" {at}" if at else ""
    return Problem(
        key,
        f"{key}: {format_bytes(limit)} ({limit} B) cannot hold the whole step{where}: the least whole-step peak any "
        f"checkpointing of ckpt.layers reaches is {least}"
        + (f"; without checkpointing {format_bytes(without.peak)}" if without is not None else ""),
        f"raise {key} to at least {least.peak}B, select more layers, shard the parameters, gradients and optimizer "
        "state (FSDP, DeepSpeed ZeRO), or lower the batch size",
        value=limit, least=least.peak)


__all__ = ["ModuleSteps", "StepFit", "WholeSteps", "fit_memory", "least_plan", "too_small", "whole_of"]
