"""``ckpt.segments: optimal``: Rotor's schedule, against every nesting, MemTracker and the fixed schedules.

The outside solver the issue names (rkgb/rockmate's Rotor) prices a GPU step, in which a
segment's output gradient is held through it and an activation's gradient has its size;
our budget is MemTracker's activation category, without gradients: the optimal costs answer
different questions. So the solver is checked against every nesting of checkpointed regions
instead: walked one by one (``simulate``) on chains of up to 6 layers, composed from the
outcomes of every sub-schedule (no pruning) on chains of 7 and 8.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import re

import pytest
import torch
from conftest import FAST, TINY_GPT, compose_train, gpt_batch, small_gpt
from torch import nn

from ckpt_plugin import (
    ActivationCheckpointing,
    apply_checkpointing,
    checkpoint_sequential,
    remove_checkpointing,
)
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.plan import Segments, WrapPlan
from ckpt_plugin.engine.segments.sequential import Region, regions, schedule
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import install, wrapped_modules
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.memory import step_flops, step_memory
from ckpt_plugin.units import format_bytes
from ckpt_plugin.config.budget import Budget, parse_budget
from ckpt_plugin.planning.profile import chain_costs
from ckpt_plugin.planning.rotor import (
    ChainCosts,
    Unreachable,
    least_peak,
    simulate,
    solve,
    tradeoffs,
)
from ckpt_tools.workloads import MODELS
from recipes.train import train

# ----------------------------------------------------------------------------- every nesting


def nestings(start: int, stop: int, whole: bool = True):
    """Every schedule over ``start..stop-1``: regions nest at any depth, a region's last child may be a region.

    ``whole=False`` leaves out a region spanning everything (a region's only child, a region of its
    own span, changes nothing).
    """
    if start == stop:
        yield ()
        return
    for rest in nestings(start + 1, stop):
        yield (start, *rest)
    for end in range(start + 1, stop + 1 if whole else stop):
        for inner in nestings(start, end, whole=False):
            for rest in nestings(end, stop):
                yield (Region(start, end, inner), *rest)


def composed_outcomes(c: ChainCosts) -> set[tuple[int, int]]:
    """(peak, recomputed FLOPs) of every nesting, composed from those of its parts, without pruning any."""
    x, nothing = (*c.input_bytes, 0), -(10**18)

    @functools.cache
    def lists(s: int, t: int, recomputing: bool, whole: bool = True) -> frozenset:
        if s == t:
            return frozenset({(nothing if recomputing else c.after_running, 0)})
        extra = c.backward_bytes if recomputing else 0
        out = set()
        if recomputing and s + 1 == t:  # the last layer of a recomputation stops at its last saved tensor
            out.add((c.last_running_bytes[s] - x[s], c.last_flops[s]))
        else:
            need, add = c.running_bytes[s] - x[s] + extra, c.kept_bytes[s] + x[s + 1]
            f = c.flops[s] if recomputing else 0
            out |= {(max(need, add + n), f + g) for n, g in lists(s + 1, t, recomputing)}
        for e in range(s + 1, t + 1 if whole else t):
            inner = lists(s, e, True, False)
            if recomputing and e == t:  # a trailing region: its parent's recomputation stops at its input
                out |= inner
                continue
            need = max([c.region_running_bytes[s] - x[s], *c.region_running_bytes[s + 1:e]]) + extra
            f = sum(c.flops[s:e]) if recomputing else 0
            out |= {(max(need, x[e] + n, m), f + g + h) for n, g in lists(e, t, recomputing) for m, h in inner}
        return frozenset(out)

    return {(x[0] + need, flops) for need, flops in lists(0, c.length, False)}


def random_chain(length: int, rng: random.Random) -> ChainCosts:
    x = [rng.randint(1, 20) for _ in range(length)]
    kept = [rng.randint(0, 30) for _ in range(length)]
    back = rng.randint(0, 5)
    running = [x[k] + kept[k] + rng.randint(0, 15) for k in range(length)]
    flops = [rng.randint(1, 50) for _ in range(length)]
    return ChainCosts(
        input_bytes=tuple(x), kept_bytes=tuple(kept), running_bytes=tuple(running),
        region_running_bytes=tuple(x[k] + rng.randint(0, running[k] - x[k]) for k in range(length)),
        last_running_bytes=tuple(x[k] + back + rng.randint(0, running[k] - x[k]) for k in range(length)),
        flops=tuple(flops), last_flops=tuple(rng.randint(0, f) for f in flops),
        after_running=rng.randint(0, 40), backward_bytes=back,
    )


def check_against(c: ChainCosts, outcomes: set[tuple[int, int]]) -> None:
    least, most = min(p for p, _ in outcomes), max(p for p, _ in outcomes)
    assert least_peak(c) == least
    for limit in sorted({least - 1, least, most, *range(least, most + 1, max(1, (most - least) // 12))}):
        best = min((f for p, f in outcomes if p <= limit), default=None)
        if best is None:
            with pytest.raises(Unreachable) as info:
                solve(c, limit)
            assert info.value.least == least
            continue
        solution = solve(c, limit)
        assert solution.recompute_flops == best, (limit, solution)
        # What it claims is what its schedule costs under the model, walked step by step.
        assert simulate(c, solution.schedule) == (solution.predicted_peak, best)
        assert solution.predicted_peak <= limit
        assert schedule(c.length, solution.schedule) == list(solution.schedule)  # a valid schedule


@pytest.mark.parametrize("length", range(1, 7))
def test_solver_against_every_nesting_walked(length: int) -> None:
    rng = random.Random(length)
    every = list(nestings(0, length))
    for _ in range(3 if length < 6 else 1):
        c = random_chain(length, rng)
        walked = {simulate(c, nodes) for nodes in every}
        assert walked == composed_outcomes(c)  # the composition below is every nesting's outcome too
        check_against(c, walked)


@pytest.mark.parametrize("length", [7, 8])
def test_solver_against_every_nesting_composed(length: int) -> None:
    rng = random.Random(length)
    for _ in range(3):
        c = random_chain(length, rng)
        check_against(c, composed_outcomes(c))


# ----------------------------------------------------------------------------- the model against MemTracker


class Chain(nn.Module):
    """Linear+GELU layers of varying widths, a head and a loss."""

    def __init__(self, widths: list[int], batch: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in itertools.pairwise(widths)))
        self.head = nn.Linear(widths[-1], 10)
        self.x = torch.randn(batch, widths[0])

    def loss(self) -> torch.Tensor:
        return self.head(self.blocks(self.x)).square().mean()


def measured(model: nn.Module, loss, nodes=None, names=(), memory: bool = True) -> tuple[int | None, int]:
    """(MemTracker act peak, FLOPs) of one step, under ``nodes`` (a schedule over ``names``) or as it is."""
    if nodes is not None:
        install(model, WrapPlan((Segments(tuple(names), tuple(nodes), Treatment(checkpointing=True)),)))

    def step() -> None:
        loss().backward()
        model.zero_grad(set_to_none=True)

    try:
        return step_memory(step, model)["act"] if memory else None, step_flops(step)
    finally:
        remove_checkpointing(model)


WIDTHS = [64, 256, 32, 512, 128, 64, 384, 96, 48]


def test_the_memory_model_is_memtrackers_act_peak_on_a_chain_of_varying_widths() -> None:
    model = Chain(WIDTHS)
    names = [f"blocks.{i}" for i in range(8)]
    costs, none_peak = chain_costs(model, names, model.loss)
    assert chain_costs(model, names, model.loss, fake=False) == (costs, none_peak)  # fake tensors: the real bytes
    none_act, none_flops = measured(model, model.loss)
    assert none_act == none_peak == simulate(costs, range(8))[0]
    frontier = tradeoffs(costs)  # every peak where more memory saves FLOPs: 24 schedules here
    assert len(frontier) > 10 and frontier[0][0] == least_peak(costs)
    chosen = [solve(costs, frontier[i][0]).schedule for i in (0, 2, len(frontier) // 2, -3)]
    assert any(isinstance(c, Region) for n in chosen[0] if isinstance(n, Region) for c in n.children)  # nested
    for nodes in [schedule(8, "sqrt"), schedule(8, "recursive"), *chosen]:
        act, flops = measured(model, model.loss, nodes, names)
        assert simulate(costs, nodes) == (act, flops - none_flops), nodes  # exact, bytes and FLOPs


# ----------------------------------------------------------------------------- the GPT


@pytest.fixture(scope="module")
def gpt_runs():
    """The bench's GPT (--quick): none, sqrt, recursive, and optimal at sqrt's measured act peak."""
    spec = MODELS["gpt"]

    def build():
        torch.manual_seed(0)  # the same weights
        return spec.plain(**spec.quick).train()

    model = build()  # measured as it is and with fixed segments, then left as it is
    batch = spec.batch(model, torch.Generator().manual_seed(1))
    runs = {"none": measured(model, lambda: model.loss(batch), memory=False)}
    for segments in ("sqrt", "recursive"):  # the same regions on 4 layers: [(0-1), (2-3)]
        apply_checkpointing(model, layers="TransformerBlock", segments=segments)
        runs[segments] = measured(model, lambda: model.loss(batch), memory=segments == "sqrt")
    budget = runs["sqrt"][0]
    optimal = build()
    plan = plan_for(optimal, make_config(layers="TransformerBlock", segments="optimal", budget=f"{budget}B"),
                    lambda: optimal.loss(batch))
    install(optimal, plan)
    runs["optimal"] = measured(optimal, lambda: optimal.loss(batch))
    install(optimal, plan)  # measured() took it off
    return runs, plan, budget, (model, optimal, batch)


def test_gpt_optimal_at_sqrts_memory_recomputes_less(gpt_runs) -> None:
    runs, plan, budget, _ = gpt_runs
    flops = {mode: f - runs["none"][1] for mode, (_, f) in runs.items()}
    assert flops["optimal"] <= flops["sqrt"] and flops["optimal"] < flops["recursive"]
    assert runs["optimal"][0] <= budget  # the measured act peak fits
    assert (plan.planned.predicted_peak, plan.planned.recompute_flops) == (runs["optimal"][0], flops["optimal"])
    summary = plan.summary.splitlines()
    assert summary[0].startswith("ckpt.segments=optimal over the 4 layers blocks.0 .. blocks.3 for ckpt.budget=")
    assert summary[1].startswith("schedule (")
    assert "the least any schedule reaches is" in summary[2]


def test_gpt_optimal_gradients_are_bitwise_those_without_checkpointing(gpt_runs) -> None:
    _, plan, _, (plain, ours, batch) = gpt_runs

    def grads(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(3)  # dropout: the same masks, replayed on recompute
        model.loss(batch).backward()
        out = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    assert wrapped_modules(ours) == [f"blocks.{i}" for i in range(4)] and regions(plan.groups[0].segments)
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(ours), strict=True))


def test_checkpoint_sequential_runs_a_planned_schedule() -> None:
    model = Chain([32, 64, 16, 64, 32, 8])
    costs, _ = chain_costs(model, [f"blocks.{i}" for i in range(5)], model.loss)
    nodes = solve(costs, least_peak(costs)).schedule
    assert any(isinstance(n, Region) and any(isinstance(c, Region) for c in n.children) for n in nodes)  # nested
    x = model.x.clone().requires_grad_()
    expected = torch.autograd.grad(model.blocks(x).sum(), x)[0]
    assert torch.equal(torch.autograd.grad(checkpoint_sequential(model.blocks, nodes, x).sum(), x)[0], expected)


# ----------------------------------------------------------------------------- errors


def test_a_budget_below_the_least_peak_names_it(gpt_runs) -> None:
    _, plan, _, (model, _, batch) = gpt_runs
    least = plan.planned.least_peak
    config = make_config(layers="TransformerBlock", segments="optimal", budget=f"{least - 1}B")
    with pytest.raises(ConfigError, match=re.escape(
            f"ckpt.budget: {least - 1} bytes (") + r"[\d.]+ MiB, 0\.\d\d of the activation peak without checkpointing, "
            + re.escape(f"7.9 MiB) cannot be met by ckpt.segments=optimal: the least peak any schedule of the chain "
                        f"reaches is {least} bytes (") + r"[\d.]+ MiB, 0\.\d\d\); raise ckpt\.budget to at least "
            r"0\.\d\d or " + f"{least}B$"):
        plan_for(model, config, lambda: model.loss(batch))
    # The size it names can be typed back (as a budget it is met: test_solver_against_every_nesting_*).
    assert parse_budget(f"{least}B", typed=True) == Budget(bytes=least)


@pytest.mark.parametrize(("keys", "message"), [
    ({"budget": 0.5},
     ("ckpt.budget=0.5 is only read with ckpt.segments=optimal, not ckpt.segments=null; set ckpt.segments=optimal "
      "(the least recomputation that fits the budget), or drop ckpt.budget (ckpt=auto takes a budget too: it chooses "
      "per layer)")),
    ({"budget": "2GiB", "segments": "sqrt"},
     "ckpt.budget='2GiB' is only read with ckpt.segments=optimal, not ckpt.segments=sqrt; set ckpt.segments=optimal"),
    ({"segments": "optimal"},
     ("ckpt.segments=optimal needs ckpt.budget: a fraction of the activation peak without checkpointing (0.3) or a "
      "size (2GiB); or choose ckpt.segments=sqrt or recursive, which need no budget")),
    ({"segments": "optimal", "budget": "lots"},
     ("ckpt.budget='lots' is not a budget: write a fraction of the activation peak without checkpointing (0.4, 40%), "
      "a size (2GiB, 512MiB, 300MB, '2 GiB', or an integer number of bytes), or min (the least peak reachable)")),
    ({"segments": "optimal", "budget": 1.5},
     "ckpt.budget=1.5: a fraction must be in (0, 1]; for a size write e.g. 1.5GiB"),
    ({"mode": "selective", "segments": "optimal"},
     ("ckpt.segments=optimal is planned for ckpt=full's regions, which keep only their inputs: a selective region "
      "also keeps the outputs of the ops its policy saves, which the schedule's memory model does not count; use "
      "ckpt=full ckpt.segments=optimal ckpt.budget=..., or with ckpt=selective an integer, sqrt or recursive")),
    ({"segments": "optimal", "budget": 0.5, "every_n": 2},
     "ckpt.segments=optimal cannot be combined with ckpt.every_n=2"),
])
def test_budget_and_optimal_errors(keys, message) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        apply_checkpointing(MODELS["gpt"].plain(**MODELS["gpt"].quick), layers="TransformerBlock", **keys)


def test_a_schedule_that_does_not_cover_the_chain() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "segments: the schedule [0, Region(start=2, stop=3, children=(2,))] does not cover the 3 layers 0..L-1 "
            "in order (each region by its children)")):
        checkpoint_sequential([torch.sin] * 3, [0, Region(2, 3, (2,))], torch.ones(2))
    with pytest.raises(ConfigError, match=r"^segments='optimal' is planned from the layers' costs and a memory "
                       r"budget, not from their number"):
        checkpoint_sequential([torch.sin] * 3, "optimal", torch.ones(2))


# ----------------------------------------------------------------------------- from the entry point


def test_optimal_through_hydra_and_the_trainer(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe's outputs (Lightning's logs) land here
    cfg = compose_train(*TINY_GPT, *FAST, "ckpt.segments=optimal", "ckpt.budget=0.3")
    with caplog.at_level(logging.INFO):
        trainer = train(cfg)
    assert trainer.global_step == 2
    out = caplog.text
    assert "ckpt.segments=optimal over the 4 layers blocks.0 .. blocks.3 for ckpt.budget=0.3" in out, out[-3000:]
    assert re.search(r"schedule \(\d+ checkpointed regions?\): \[", out)
    callback = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
    assert callback.wrapped == [f"blocks.{i}" for i in range(4)] and callback.planned.predicted_peak > 0


# ----------------------------------------------------------------------------- inside ckpt=auto


def test_auto_below_what_per_layer_plans_reach_nests_regions_over_the_chain() -> None:
    """A chain of varying widths: no option per layer (or inside it) reaches what nested regions reach.
    ckpt.budget=min plans Rotor's least peak; a byte budget at it is met the same way, exactly as the step
    then measures; a byte less is refused naming it."""
    plain, model = Chain(WIDTHS), Chain(WIDTHS)
    names = [f"blocks.{i}" for i in range(len(WIDTHS) - 1)]
    least_plan = plan_for(model, make_config(mode="auto", layers="blocks.*", budget="min"), model.loss)
    least = least_plan.planned.predicted_peak
    assert least == least_peak(chain_costs(model, names, model.loss)[0])
    assert f"reaches {format_bytes(least)} (ckpt.budget=min), as nested regions do" in least_plan.summary
    plan = plan_for(model, make_config(mode="auto", layers="blocks.*", budget=f"{least}B"), model.loss)
    (group,) = plan.groups
    assert isinstance(group, Segments) and any(isinstance(n, Region) for n in group.segments)
    assert f"no choice per layer (keep, selective, full, or parts of it) fits ckpt.budget={least}B" in plan.summary
    assert "Rotor's schedule" in plan.summary and plan.planned.predicted_peak == least
    with pytest.raises(ConfigError, match=r"cannot be met by ckpt=auto: the least peak of regions nested over the "
                       rf"chain, below any one option per layer reaches is {least} bytes .*; raise ckpt\.budget "
                       rf"to at least [0-9.]+ or {least}B"):
        plan_for(model, make_config(mode="auto", layers="blocks.*", budget=f"{least - 1}B"), model.loss)
    install(model, plan)
    assert step_memory(lambda: model.loss().backward(), model)["act"] == least
    for m in (plain, model):
        m.zero_grad(set_to_none=True)
        m.loss().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_auto_budget_min_on_a_gpt_nests_regions_over_its_blocks() -> None:
    """An 8-block GPT: one option per block (or inside it) reaches 0.139 of the peak without checkpointing,
    nested regions 0.126; ckpt.budget=min installs Rotor's schedule, whose peak the step measures exactly,
    with gradients bitwise those without checkpointing."""
    plain, model = small_gpt(dropout=0.0, n_layer=8), small_gpt(dropout=0.0, n_layer=8)
    batch = gpt_batch(model)
    plan = plan_for(model, make_config(mode="auto", layers="blocks.*", budget="min"), lambda: model.loss(batch))
    (group,) = plan.groups
    assert isinstance(group, Segments) and any(isinstance(n, Region) for n in group.segments)
    assert "(ckpt.budget=min), as nested regions do" in plan.summary
    install(model, plan)

    def step(m):
        torch.manual_seed(5)
        m.loss(batch).backward()

    none_peak = step_memory(lambda: step(plain), plain)["act"]
    assert step_memory(lambda: step(model), model)["act"] == plan.planned.predicted_peak < 0.13 * none_peak
    for p in (*plain.parameters(), *model.parameters()):
        p.grad = None
    step(plain), step(model)
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
