"""ckpt=auto inside the layers (``planning/inside.py``): a layer's parts are candidates too.

A budget under the least peak the layers' own options reach is met by
checkpointing parts of a layer (the layer unwrapped, or ``full`` with its parts
checkpointed inside its recomputation). Checked as the rest of ``ckpt=auto``
is: the predicted peak against MemTracker's act peak of the installed plan
(to the byte on the GPT), gradients bitwise those without checkpointing, the
inner programme against every choice of the parts' options, fake tensors
against real ones, and through ``apply_config`` with its timing.
"""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch
from conftest import added_in_order, gpt_batch, resnet_batch, small_gpt, small_resnet

from ckpt_plugin import remove_checkpointing
from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.wrap import install
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.memory import step_memory
from ckpt_plugin.planning.inside import Chain, with_inside
from ckpt_plugin.planning.nofit import NoFit
from ckpt_plugin.planning.options import FULL, INSIDE, KEEP, OPTIONS, SELECTIVE, Option
from ckpt_plugin.planning.planner import Cost, LayerProfile, plan, smallest_peak
from ckpt_plugin.planning.profile import INSIDE_DEPTH, ProfileCache, profile, wrap_plan
from ckpt_plugin.planning.timing import measure_layer_times
from ckpt_plugin.planning.profile import treatment

BLOCKS = ["blocks.0", "blocks.1"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt() -> dict:
    """A 2-block GPT (dropout on): its profiles without and with parts, a plain step's gradients."""
    model = small_gpt(n_layer=2, n_embd=64, block_size=32)
    batch = gpt_batch(model)
    forward = lambda: model.loss(batch)  # noqa: E731
    flat = profile(model, BLOCKS, forward)
    deep = profile(model, BLOCKS, forward, depth=INSIDE_DEPTH)
    torch.manual_seed(0)
    model.loss(batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"model": model, "batch": batch, "forward": forward, "flat": flat, "deep": deep, "grads": grads}


def test_a_deeper_profile_from_the_cache_equals_one_measured_afresh(gpt) -> None:
    """ckpt=auto profiles the layers, then, after a refusal, their parts too: the second profile reads the
    layers' steps back from a ProfileCache instead of running them again, and measures exactly the same."""
    cache = ProfileCache()
    assert profile(gpt["model"], BLOCKS, gpt["forward"], cache=cache) == gpt["flat"]
    assert list(cache.steps) == [(tuple(BLOCKS), True)]
    stepped = cache.steps[tuple(BLOCKS), True]
    assert profile(gpt["model"], BLOCKS, gpt["forward"], depth=INSIDE_DEPTH, cache=cache) == gpt["deep"]
    assert cache.steps[tuple(BLOCKS), True] is stepped


def _least(prof) -> int:
    return smallest_peak(prof.layers, prof.rest_running)


def _installed(model, chosen, batch, regrouped=()) -> tuple[int, dict[str, torch.Tensor]]:
    """(MemTracker's act peak, gradients) of a step with ``chosen`` installed (``regrouped``: the profile's layers
    with op groups); the model left unwrapped."""

    def step() -> None:
        torch.manual_seed(0)
        model.loss(batch).backward()

    install(model, wrap_plan(chosen, regrouped=regrouped))
    try:
        step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        act = step_memory(lambda: (step(), model.zero_grad(set_to_none=True)), model)["act"]
    finally:
        remove_checkpointing(model)
    return act, grads


def test_parts_reach_below_what_the_layers_reach(gpt: dict) -> None:
    flat, deep = gpt["flat"], gpt["deep"]
    assert _least(deep) < 0.8 * _least(flat)
    refused = flat.fit(_least(deep))
    assert isinstance(refused, NoFit) and refused.least == _least(flat)
    chosen = deep.plan(_least(deep))
    assert set(chosen.choices) > set(BLOCKS)  # parts named, after their layer
    assert all(name.startswith(tuple(f"{b}." for b in BLOCKS)) for name in set(chosen.choices) - set(BLOCKS))


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_an_inside_plan_predicts_its_peak_to_the_byte_and_trains_bitwise(gpt: dict, where: float) -> None:
    """Budgets from the least peak with parts to the least without: the act peak is the predicted one, exactly."""
    deep = gpt["deep"]
    low, high = _least(deep), _least(gpt["flat"])
    budget = int(low + where * (high - low))
    chosen = deep.plan(budget)  # measured with the plan on, on fake tensors
    modelled = plan(deep.layers, deep.rest_bytes, budget, rest_running=deep.rest_running)  # the peak model alone
    assert chosen.peak_measured and modelled.choices == chosen.choices
    assert any(option == INSIDE or name not in BLOCKS for name, option in chosen.choices.items())
    act, grads = _installed(gpt["model"], chosen, gpt["batch"])
    assert act == chosen.predicted_peak == modelled.predicted_peak <= budget
    assert all(torch.equal(grads[n], g) for n, g in gpt["grads"].items())


def _alone(prof, index: int, option: Option):
    """The plan with layer ``index`` under ``option`` and every other layer kept."""
    layers = [LayerProfile(layer.name, {option: layer.options[option]} if i == index else {KEEP: layer.options[KEEP]})
              for i, layer in enumerate(prof.layers)]
    return plan(layers, prof.rest_bytes, 2**62, rest_running=prof.rest_running)


def test_every_option_inside_a_gpt_block_predicts_its_peak_to_the_byte(gpt: dict) -> None:
    last = gpt["deep"].layers[-1]
    inside = [o for o in last.options if o not in OPTIONS]
    assert {o.kind for o in inside} == {INSIDE, FULL}  # unwrapped with parts, and nested
    for option in inside:
        chosen = _alone(gpt["deep"], len(BLOCKS) - 1, option)
        assert _installed(gpt["model"], chosen, gpt["batch"])[0] == chosen.predicted_peak, option


def test_every_option_inside_a_resnet_predicts_its_peak_to_the_byte() -> None:
    """BatchNorm, a Sequential stem (its ReLU saves its output, not its input), a downsampling block's shortcut."""
    model = small_resnet(depths=(1, 1))
    batch = resnet_batch(model)
    names = ["stem", "stages.0.0", "stages.1.0"]
    prof = profile(model, names, lambda: model.loss(batch), depth=INSIDE_DEPTH)
    checked = 0
    for index, layer in enumerate(prof.layers):
        for option in [o for o in layer.options if o not in OPTIONS]:
            chosen = _alone(prof, index, option)
            assert _installed(model, chosen, batch, prof.regrouped)[0] == chosen.predicted_peak, (
                layer.name, option, chosen.choices)
            checked += 1
    assert checked >= 4


def test_the_plan_table_names_the_parts_under_their_layer(gpt: dict) -> None:
    chosen = gpt["deep"].plan(_least(gpt["deep"]))
    lines = str(chosen).splitlines()
    for name, option in chosen.choices.items():
        depth = name.count(".") - 1  # blocks.0 at 0, blocks.0.attn at 1, blocks.0.attn.proj at 2
        assert f"{'  ' * depth}{name} " in "\n".join(lines) and any(
            line.split()[:2] == [name, str(option)] and line.startswith("  " * depth + name) for line in lines), name
    assert any(line.startswith("indented: parts checkpointed inside the layer above") for line in lines)
    assert f"({chosen.predicted_peak} B), measured with the plan on (fake tensors)" in str(chosen)


def test_fake_tensors_measure_the_parts_as_real_ones_do(gpt: dict) -> None:
    real = profile(gpt["model"], BLOCKS, gpt["forward"], fake=False, depth=INSIDE_DEPTH)
    assert real == gpt["deep"]


def _brute(chain: Chain, parts: list[dict[Option, Cost]]):
    """(kept, running, backward running, seconds, FLOPs) of every choice of the parts' options, written out;
    every part kept is the layer as it is, not a choice inside it."""
    for chosen in itertools.product(*(list(p.items()) for p in parts)):
        if all(option == KEEP for option, _ in chosen):
            continue
        combo = [c for _, c in chosen]
        kept = peak = 0
        late = chain.glue_running[0] + chain.held
        peak = chain.glue_running[0]
        for j, c in enumerate(combo, 1):
            peak = max(peak, kept + c.running_bytes)
            late = max(late, kept + c.backward_running)
            kept += c.kept_bytes
            peak = max(peak, kept + chain.glue_running[j])
            late = max(late, kept + chain.glue_running[j] + chain.held)
        yield (chain.glue_kept + kept, peak, late, added_in_order(c.seconds for c in combo),  # as _frontier adds
               sum(c.recompute_flops for c in combo))


@pytest.mark.parametrize("seed", range(6))
def test_the_inner_programme_misses_no_choice_of_the_parts(seed: int) -> None:
    """Every choice of the parts' options (3^k of them) is matched or beaten by an option it returns."""
    rng = random.Random(seed)
    k = rng.randint(1, 5)
    names = [f"block.p{j}" for j in range(k)]
    leaves = {"block": {KEEP: Cost(500, 0, 800), SELECTIVE: Cost(300, 0, 800, 0.5),
                        FULL: Cost(40, 900, 800, 2.0)}}
    for name in names:
        keep = rng.randint(20, 200)
        leaves[name] = {o: Cost(kept, flops, run, seconds, backward_running=run + rng.randint(0, 30))
                        for o, kept, flops, run, seconds in [
                            (KEEP, keep, 0, keep + rng.randint(0, 100), 0.0),
                            (SELECTIVE, rng.randint(5, keep), rng.randint(0, 50), rng.randint(10, keep + 80),
                             rng.choice([0.0, rng.random()])),
                            (FULL, rng.randint(5, 20), rng.randint(50, 200), rng.randint(keep // 2, keep + 150),
                             rng.random())]}
    chain = Chain(tuple(names), rng.randint(0, 50), tuple(rng.randint(0, 120) for _ in range(k + 1)),
                  rng.randint(100, 300), held=rng.randint(0, 20))
    options = with_inside("block", leaves, {"block": chain})
    full = leaves["block"][FULL]
    for kept, peak, late, seconds, flops in _brute(chain, [leaves[n] for n in names]):
        wanted = [(kept, peak, seconds, flops), (full.kept_bytes, max(chain.forward_running, late),
                                                 full.seconds + seconds, full.recompute_flops + flops)]
        for want in wanted:
            assert any(c.kept_bytes <= want[0] and c.running_bytes <= want[1]
                       and (c.seconds, c.recompute_flops) <= (want[2], want[3]) for c in options.values()), want


def test_apply_config_meets_a_budget_the_layers_alone_cannot(gpt: dict) -> None:
    """Through ckpt=auto with its timing: parts are wrapped and the act peak fits, where one option per block
    cannot; too little is refused, naming the least peak, below what one option per block reaches."""
    model, batch = gpt["model"], gpt["batch"]
    low, high = _least(gpt["deep"]), _least(gpt["flat"])
    budget = (low + high) // 2
    wrapped = apply_config(model, make_config(mode="auto", layers="TransformerBlock", budget=budget),
                           forward=gpt["forward"])
    try:
        assert set(wrapped) - set(BLOCKS)  # parts of the blocks among what is wrapped
        act = step_memory(lambda: (model.loss(batch).backward(), model.zero_grad(set_to_none=True)), model)["act"]
    finally:
        remove_checkpointing(model)
    assert act <= budget
    refused = gpt["deep"].fit(low - 1)
    assert isinstance(refused, NoFit) and (refused.budget_bytes, refused.least) == (low - 1, low)
    # Through ckpt=auto (which may then try nested regions over the chain): the least peak named is at most that.
    with pytest.raises(ConfigError, match=r"cannot be met") as refused:
        apply_config(model, make_config(mode="auto", layers="TransformerBlock", budget=4096), forward=gpt["forward"])
    named = refused.value.problems[0].least
    assert named <= low < high


def test_parts_are_timed_alone_and_stay_out_of_the_step_prediction(gpt: dict) -> None:
    model = gpt["model"]
    parts = {"blocks.0.mlp": [FULL], "blocks.1.mlp": [FULL], "blocks.0.attn.proj": [SELECTIVE]}
    times = measure_layer_times(model, BLOCKS, gpt["forward"], {o: treatment(o) for o in OPTIONS}, repeats=1,
                                parts=parts)
    assert times.parts == tuple(parts)
    assert times.seconds["blocks.0.mlp"].keys() == {KEEP, FULL} and all(
        s > 0 for s in times.seconds["blocks.0.attn.proj"].values())
    assert times.predicted_none_seconds == pytest.approx(
        times.full_step_seconds - sum(times.added(b, FULL) for b in BLOCKS))
    assert re.search(r"blocks\.0\.mlp .* - ", str(times))  # no selective timing for it
    with pytest.raises(ValueError, match=r"parts 'blocks.0': not modules of GPT apart from the layers"):
        measure_layer_times(model, BLOCKS, gpt["forward"], {o: treatment(o) for o in OPTIONS}, parts={"blocks.0": []})
