"""``ckpt=auto``'s strategies, in the one order it tries them, each answering with data: a plan, or a
:class:`~ckpt_plugin.planning.nofit.NoFit` that says the least peak it reaches.

1. :class:`PerLayer` at depth 0: one option per layer (keep, selective with either matmul
   policy, full), the least added step time that fits (``planning/planner.py``).
2. :class:`PerLayer` at ``INSIDE_DEPTH``: the layers' parts too (``planning/inside.py``);
   measured only when asked, as they double the profile's cost. Eager steps only.
3. :class:`NestedRegions`: Rotor's nesting of checkpointed regions over the layers, if they
   form a chain (``planning/rotor.py``); the least recomputed FLOPs that fit. Nested
   regions recompute more than any per-layer plan that fits, so they come last. Eager
   steps only: a region spans several layers' calls, opened and closed by hooks, which
   ``torch.compile`` cannot capture as one graph.

For a budget the first that fits wins; where none does, the refusal is the one of the
strategy that reaches lowest (the earlier on a tie). For ``ckpt.budget=min`` each
strategy no later one covers gives its least plan, and the lowest peak wins (the
earlier on a tie: it recomputes less). A new strategy is one more class in that list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ckpt_plugin.apply.segments import chain_problems
from ckpt_plugin.config.budget import Budget, cannot_meet, resolve
from ckpt_plugin.engine.plan import Segments, WrapPlan
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import check_plan
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.measure.sample import scalar
from ckpt_plugin.planning.link import host_link
from ckpt_plugin.planning.nofit import NoFit
from ckpt_plugin.planning.offload_plan import Link
from ckpt_plugin.planning.options import Option
from ckpt_plugin.planning.planner import Plan, Profile
from ckpt_plugin.planning.profile import (
    INSIDE_DEPTH,
    ProfileCache,
    chain_costs,
    profile,
    wrap_plan,
)
from ckpt_plugin.planning.rotor import ChainCosts, Solution, fit, least_peak


@dataclass
class Measuring:
    """What every strategy plans from: the model, the candidate layers and a sample forward, each cost measured
    once (the layers are stepped and timed once, should their parts be measured later)."""

    model: nn.Module
    names: list[str]
    forward: Callable[[], Any]
    compiled: dict[Option, str]  # the options timed compiled (apply.auto.timed_compiled)
    preserve_rng_state: bool
    timing_forward: Callable[[], Any] | None = None  # what the options are timed on (None: forward)
    timed: bool = True  # False: memory only (ckpt.batch=max's search for the least plan's peak)
    # False where the layers run somewhere else than where they sit (each its own FSDP unit): a region over
    # several would recompute units FSDP has resharded, so only per-layer plans are made (apply/twin.py).
    chains: bool = True
    offload: bool = True  # ckpt.offload: layers may be planned offload where a host link is measured
    _cache: ProfileCache = field(default_factory=ProfileCache)
    _profiles: dict[int, Profile] = field(default_factory=dict)
    _link: tuple[Link | None, str] | None = None

    def run(self) -> Any:
        return scalar(self.forward())

    @property
    def link(self) -> tuple[Link | None, str]:
        """(the host link offload is priced on, or None) and the plan's line where there is none; measured once,
        on the device the model's parameters are on (``planning/link.py``)."""
        if self._link is None:
            device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
            self._link = host_link(device, self.offload)
        return self._link

    def profile(self, depth: int) -> Profile:
        if depth not in self._profiles:
            timed_on = self.run if self.timing_forward is None else lambda: scalar(self.timing_forward())
            link, no_link = self.link if self.timed else (None, "")
            self._profiles[depth] = profile(self.model, self.names, self.run, timed=self.timed, compiled=self.compiled,
                                            depth=depth, cache=self._cache, timing_forward=timed_on, link=link,
                                            no_link=no_link)
        return self._profiles[depth]


class PerLayer:
    """One option per layer; from ``depth`` 1, parts of a layer too."""

    def __init__(self, measuring: Measuring, depth: int = 0) -> None:
        self.measuring, self.depth = measuring, depth

    @property
    def measured(self) -> Profile:
        return self.measuring.profile(self.depth)

    @property
    def reference(self) -> int:
        return self.measured.no_ckpt_peak

    def available(self) -> bool:
        return True

    def covers(self, other: object) -> bool:
        """Whether every plan of ``other`` is one of this strategy's too (a shallower per-layer plan is)."""
        return isinstance(other, PerLayer) and other.depth <= self.depth

    def fit(self, budget: Budget) -> Plan | NoFit:
        return self.measured.fit(resolve(budget, self.reference))

    def least(self) -> Plan:
        return self.measured.least()

    def refusal(self, miss: NoFit) -> Problem:
        return cannot_meet(miss.budget_bytes, miss.least, miss.reference, by="checkpointing ckpt.layers",
                           hint=", or select more layers")

    def installed(self, chosen: Plan) -> WrapPlan:
        return wrap_plan(chosen, self.measuring.preserve_rng_state, self.measured.regrouped)


class NestedRegions:
    """Rotor's schedule of nested checkpointed regions over the layers, where they form a chain (checked where they
    sit and on the sample, as ``ckpt.segments`` is); cost: recomputed FLOPs."""

    def __init__(self, measuring: Measuring) -> None:
        self.measuring = measuring
        self.treatment = Treatment(checkpointing=True, preserve_rng_state=measuring.preserve_rng_state)
        self._chain: bool | None = None
        self._costs: tuple[ChainCosts, int] | None = None

    def available(self) -> bool:
        if self._chain is None:
            m = self.measuring
            if not m.chains:
                self._chain = False
                return False
            try:
                check_plan(m.model, WrapPlan((Segments(tuple(m.names), 1, self.treatment),)))
                self._chain = not chain_problems(m.model, m.names, m.forward)
            except ConfigError:
                self._chain = False
        return self._chain

    def covers(self, other: object) -> bool:
        return other is self

    def _measured(self) -> tuple[ChainCosts, int]:
        """The chain's costs and the activation peak without checkpointing, measured together, once."""
        if self._costs is None:
            self._costs = chain_costs(self.measuring.model, self.measuring.names, self.measuring.run)
        return self._costs

    @property
    def costs(self) -> ChainCosts:
        return self._measured()[0]

    @property
    def reference(self) -> int:
        return self._measured()[1]

    def fit(self, budget: Budget) -> Solution | NoFit:
        limit = resolve(budget, self.reference)
        solution = fit(self.costs, limit, self.measuring.names)
        return NoFit(limit, solution.least, self.reference) if isinstance(solution, NoFit) else solution

    def least(self) -> Solution:
        return fit(self.costs, least_peak(self.costs), self.measuring.names)

    def refusal(self, miss: NoFit) -> Problem:
        return cannot_meet(miss.budget_bytes, miss.least, miss.reference, by="ckpt=auto",
                           reaching="of regions nested over the chain, below any one option per layer reaches")

    def installed(self, chosen: Solution) -> WrapPlan:
        return WrapPlan((Segments(tuple(self.measuring.names), chosen.schedule, self.treatment),), planned=chosen)


Strategy = PerLayer | NestedRegions


def strategies(measuring: Measuring, eager: bool) -> list[Strategy]:
    """The strategies, in the order they are tried: only the first one where the step runs compiled."""
    if not eager:
        return [PerLayer(measuring)]
    return [PerLayer(measuring), PerLayer(measuring, INSIDE_DEPTH), NestedRegions(measuring)]


@dataclass(frozen=True)
class Chosen:
    """What ``ckpt=auto`` settled on: the strategy and its plan (the planner's ``Plan`` or Rotor's ``Solution``)."""

    strategy: Strategy
    plan: Plan | Solution


def first_fit(tried: list[Strategy], budget: Budget) -> Chosen | ConfigError:
    """The first strategy's plan that fits ``budget``; else the refusal of the one that reaches lowest."""
    misses: list[tuple[Strategy, NoFit]] = []
    for strategy in tried:
        if not strategy.available():
            continue
        outcome = strategy.fit(budget)
        if not isinstance(outcome, NoFit):
            return Chosen(strategy, outcome)
        misses.append((strategy, outcome))
    strategy, miss = min(misses, key=lambda pair: pair[1].least)  # min keeps the first of equals
    return ConfigError([strategy.refusal(miss)])


def least_of(tried: list[Strategy]) -> Chosen:
    """``ckpt.budget=min``: the least peak of the strategies no later one covers (the earlier on a tie)."""
    own = [s for i, s in enumerate(tried) if not any(t.covers(s) for t in tried[i + 1:])]
    chosen = [Chosen(s, s.least()) for s in own if s.available()]
    return min(chosen, key=lambda c: c.plan.predicted_peak)


__all__ = ["Chosen", "Measuring", "NestedRegions", "PerLayer", "first_fit", "least_of", "strategies"]
