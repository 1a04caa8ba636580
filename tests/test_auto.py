"""ckpt=auto: the budget, the profile, the plan's optimality, and the budget met for real.

Optimality is checked against exhaustive search over every choice of options per layer (4^L); the
real check applies the plan to a GPT and measures the step's activation peak
with MemTracker (``measure.step_memory``), exactly as DESIGN.md says.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
from conftest import added_in_order, gpt_batch, resnet_batch, small_gpt, small_resnet
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin import apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_plugin.engine.selective.policies import make_policy
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import CheckpointedForward, install
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.memory import REST, saved_bytes, step_flops, step_memory
from ckpt_plugin.planning.nofit import NoFit
from ckpt_plugin.planning.options import FULL, INSIDE, KEEP, SELECTIVE, SELECTIVE_NB, Option
from ckpt_plugin.planning.planner import Part, choose
from ckpt_plugin.config.budget import Budget, parse_budget, resolve
from ckpt_plugin.planning.options import OPTIONS
from ckpt_plugin.planning.planner import Cost, LayerProfile, Profile, plan
from ckpt_plugin.planning.profile import profile, wrap_plan

N_LAYER = 6
BLOCKS = [f"blocks.{i}" for i in range(N_LAYER)]


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- parse_budget

@pytest.mark.parametrize(("given", "expected"), [
    (0.4, Budget(fraction=0.4)),
    ("0.4", Budget(fraction=0.4)),
    ("40%", Budget(fraction=0.4)),
    (1.0, Budget(fraction=1.0)),
    (1, Budget(fraction=1.0)),  # ckpt.budget=1 on the command line is an int: the whole peak, not 1 byte
    ("2GiB", Budget(bytes=2 * 2**30)),
    ("512MiB", Budget(bytes=512 * 2**20)),
    ("300MB", Budget(bytes=300 * 10**6)),
    ("1.5GB", Budget(bytes=1_500_000_000)),
    (" 2 gib ", Budget(bytes=2 * 2**30)),
    (123456, Budget(bytes=123456)),
    ("min", Budget(least=True)),  # the least peak the planner reaches
    (" MIN ", Budget(least=True)),
])
def test_parse_budget_accepts(given, expected) -> None:
    assert parse_budget(given) == expected


@pytest.mark.parametrize(("given", "message"), [
    (None, r"ckpt=auto needs ckpt.budget: a fraction of the activation peak without checkpointing \(0.4\) or a size \(2GiB\)"),
    ("???", r"ckpt=auto needs ckpt.budget"),
    (0, r"ckpt.budget=0 must be positive"),
    (0.0, r"ckpt.budget=0.0 must be positive"),
    (-0.5, r"ckpt.budget=-0.5 must be positive"),
    (-3, r"ckpt.budget=-3 must be positive"),
    ("0GiB", r"ckpt.budget='0GiB' must be positive"),
    ("-1GiB", r"ckpt.budget='-1GiB' must be positive"),
    (1.5, r"ckpt.budget=1.5: a fraction must be in \(0, 1\]; for a size write e.g. 1.5GiB"),
    ("1.5", r"ckpt.budget='1.5': a fraction must be in \(0, 1\]; for a size write e.g. 1.5GiB"),
    ("150%", r"ckpt.budget='150%': a fraction must be in \(0, 1\]; at most 100%"),
    ("abc", r"ckpt.budget='abc' is not a budget: write a fraction .*, a size \(2GiB, 512MiB, 300MB.*, or min"),
    ("2GX", r"ckpt.budget='2GX' is not a budget"),
    ("minimum", r"ckpt.budget='minimum' is not a budget"),
    (True, r"ckpt.budget=True \(bool\) must be a fraction \(0.4\) or a size \(2GiB\)"),
    ([0.4], r"ckpt.budget=\[0.4\] \(list\) must be a fraction"),
])
def test_parse_budget_rejects(given, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_budget(given)


def test_resolve_scales_a_fraction_and_passes_bytes_through() -> None:
    assert resolve(parse_budget(0.25), 1000) == 250
    assert resolve(parse_budget("1KiB"), 10**9) == 1024


# ---------------------------------------------------------------------- plan vs exhaustive search

def _level(choices) -> int:
    return sum(OPTIONS.index(o) for o in choices)


def _all_choices(layers, rest, rest_running):
    """(peak, (seconds, flops, level), choices) of every one of the choices (4^L with four options)."""
    out = []
    for combo in itertools.product(*(list(layer.options.items()) for layer in layers)):
        # The peak model written out: while layer i runs, layers 1..i-1 keep and it has its running
        # bytes (which include the rest's keeps); after the last, every layer keeps, plus the rest's.
        before = [0, *itertools.accumulate(c.kept_bytes for _, c in combo)]
        peak = max([before[-1] + rest_running] + [k + c.running_bytes for k, (_, c) in zip(before, combo)])
        seconds = added_in_order(c.seconds for _, c in combo)  # as the planner adds them, layer by layer
        flops = sum(c.recompute_flops for _, c in combo)
        out.append((peak, (seconds, flops, _level(o for o, _ in combo)), tuple(o for o, _ in combo)))
    return out


def _check_against_exhaustive(layers, rest, rest_running, budgets) -> int:
    everything = _all_choices(layers, rest, rest_running)
    smallest = min(peak for peak, _, _ in everything)
    checked = 0
    for budget in budgets:
        fitting = [cost for peak, cost, _ in everything if peak <= budget]
        if not fitting:
            refused = choose(layers, rest, budget, rest_running=rest_running)
            assert isinstance(refused, NoFit) and (refused.budget_bytes, refused.least) == (budget, smallest)
            continue
        p = plan(layers, rest, budget, rest_running=rest_running)
        chosen = tuple(p.choices[layer.name] for layer in layers)
        peak = next(pk for pk, _, ch in everything if ch == chosen)
        assert (p.recompute_seconds, p.recompute_flops, _level(chosen)) == min(fitting)
        assert p.predicted_peak == peak <= budget
        checked += 1
    return checked


def _random_layers(rng: random.Random, n: int) -> list[LayerProfile]:
    layers = []
    for i in range(n):
        if rng.random() < 0.3:  # anything at all, ties likely
            options = {o: Cost(rng.randint(0, 40), rng.randint(0, 5), rng.randint(0, 40)) for o in OPTIONS}
            options[KEEP] = Cost(options[KEEP].kept_bytes, 0, options[KEEP].running_bytes)
        else:  # shaped like a real layer: less kept, more recompute and larger running bytes further right
            keep = rng.randint(40, 100)
            sel = rng.randint(10, keep)
            options = {
                KEEP: Cost(keep, 0, rng.randint(0, 20)),
                SELECTIVE: Cost(sel, rng.choice([0, rng.randint(1, 60)]), rng.randint(10, keep)),
                FULL: Cost(rng.randint(1, sel), rng.randint(50, 120), rng.randint(keep // 2, keep + 40)),
            }
        if rng.random() < 0.5:  # a measured step time per option, the planner's first criterion
            options = {o: replace(c, seconds=0.0 if o == KEEP else rng.choice([0.5, 1.0, rng.random()]))
                       for o, c in options.items()}
        layers.append(LayerProfile(f"layers.{i}", options))
    return layers


@pytest.mark.parametrize("n", range(1, 9))
def test_plan_is_optimal_on_random_profiles(n: int) -> None:
    rng = random.Random(n)
    for _ in range(3 if n < 8 else 1):
        layers = _random_layers(rng, n)
        rest, rest_running = rng.randint(0, 50), rng.randint(0, 60)
        peaks = sorted({peak for peak, _, _ in _all_choices(layers, rest, rest_running)})
        # Every exact peak is a budget (the boundaries), plus one below the smallest.
        budgets = [peaks[0] - 1] + (peaks if len(peaks) <= 40 else rng.sample(peaks, 40))
        assert _check_against_exhaustive(layers, rest, rest_running, budgets) == len(budgets) - 1


@pytest.mark.parametrize("n", range(1, 8))
def test_budget_min_is_the_least_peak_at_its_least_cost(n: int) -> None:
    """``ckpt.budget=min`` (``Profile.least``): the least peak of all 3^n choices, and the cheapest at that peak."""
    rng = random.Random(100 + n)
    for _ in range(3):
        layers = _random_layers(rng, n)
        rest, rest_running = rng.randint(0, 50), rng.randint(0, 60)
        everything = _all_choices(layers, rest, rest_running)
        least = min(peak for peak, _, _ in everything)
        chosen = Profile(layers, rest, rest_running, no_ckpt_peak=10**6).least()
        assert chosen.predicted_peak == chosen.budget_bytes == least
        at_least = min(cost for peak, cost, _ in everything if peak == least)
        assert (chosen.recompute_seconds, chosen.recompute_flops, _level(chosen.choices.values())) == at_least


def test_budget_min_looks_past_a_plan_inside_a_layer_that_measures_more_than_predicted() -> None:
    """Inside a layer the peak model is not exact (``Profile.least``): the plan of the least predicted peak
    measures 200 B, the next one, per layer only (exact), holds 160 B; ``min`` takes the one that holds less,
    having measured the first once."""
    part = (Part("a.x", FULL, 0, 10),)
    layers = [LayerProfile("a", {KEEP: Cost(100, 0, 150), FULL: Cost(10, 50, 160, 0.002),
                                 INSIDE.with_parts(1): Cost(20, 10, 120, 0.001, part)}),
              LayerProfile("b", {KEEP: Cost(100, 0, 100), FULL: Cost(10, 50, 100, 0.002)})]
    measured = []

    def measure(chosen) -> int:
        if len(chosen.choices) == 2:  # the layers' own options: the model is exact
            return chosen.predicted_peak
        measured.append(dict(chosen.choices))
        return 200  # every plan with a part in it

    first = Profile(layers, 0, 0, no_ckpt_peak=10**6).least()  # the model's own choice: predicted 120
    assert first.choices == {"a": INSIDE, "a.x": FULL, "b": KEEP} and first.predicted_peak == 120
    chosen = Profile(layers, 0, 0, no_ckpt_peak=10**6, measure=measure).least()
    assert measured == [first.choices]
    assert chosen.choices == {"a": FULL, "b": KEEP}  # 160 B at a's run, b keeping 100 B after it: exact
    assert chosen.predicted_peak == chosen.budget_bytes == 160 and not chosen.peak_measured


def test_a_budget_the_least_plan_meets_is_never_refused() -> None:
    """The cheapest plan for 170 B goes inside ``a`` (predicted 120 B) and measures 200 B: its estimate is charged
    and the plan that fits comes back (``a`` full, 160 B, exact). Below that least plan, the refusal names it."""
    part = (Part("a.x", FULL, 0, 10),)
    layers = [LayerProfile("a", {KEEP: Cost(100, 0, 150), FULL: Cost(10, 50, 160, 0.002),
                                 INSIDE.with_parts(1): Cost(20, 10, 120, 0.001, part)}),
              LayerProfile("b", {KEEP: Cost(100, 0, 100), FULL: Cost(10, 50, 100, 0.002)})]
    profile_ = Profile(layers, 0, 0, no_ckpt_peak=10**6,  # 200 B: every plan with a part in it; others exact
                       measure=lambda chosen: 200 if len(chosen.choices) > 2 else chosen.predicted_peak)
    chosen = profile_.plan(170)
    assert chosen.choices == {"a": FULL, "b": KEEP} and chosen.predicted_peak == 160 and chosen.budget_bytes == 170
    assert profile_.fit(150) == NoFit(150, 160, 10**6)


def test_a_plan_of_the_layers_own_options_that_measures_over_the_budget_is_not_taken() -> None:
    """The peak model is exact on the example models' layers, not on every model (Hugging Face's Funnel pools
    between its layers): the cheapest plan for 215 B, every layer kept, is predicted to hold 200 B and measures
    230 B; the plan that comes back is measured to fit."""
    layers = [LayerProfile("a", {KEEP: Cost(100, 0, 150), FULL: Cost(10, 50, 120, 0.002)}),
              LayerProfile("b", {KEEP: Cost(100, 0, 100), FULL: Cost(10, 50, 100, 0.002)})]
    measured = {}

    def measure(chosen) -> int:
        peak = 230 if set(chosen.choices.values()) == {KEEP} else chosen.predicted_peak
        measured[tuple(chosen.choices.values())] = peak
        return peak

    chosen = Profile(layers, 0, 0, no_ckpt_peak=10**6, measure=measure).plan(215)
    assert measured[(KEEP, KEEP)] == 230
    assert FULL in chosen.choices.values() and measured[tuple(chosen.choices.values())] == chosen.predicted_peak <= 215


# ---------------------------------------------------------------------- the real GPT

@pytest.fixture(scope="module")
def gpt() -> dict:
    """A float64 GPT of N_LAYER blocks: its profile, and a plain step's act peak and gradients."""
    model = small_gpt(torch.float64, n_layer=N_LAYER, n_embd=64, block_size=64)
    batch = gpt_batch(model)

    def step() -> None:
        model.loss(batch).backward()

    def plain_step() -> None:
        step()
        model.zero_grad(set_to_none=True)

    rng = torch.get_rng_state()
    prof = profile(model, BLOCKS, lambda: model.loss(batch))
    assert torch.equal(torch.get_rng_state(), rng)  # profiling drew no random numbers
    torch.manual_seed(0)
    step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"model": model, "batch": batch, "step": step, "profile": prof, "grads": grads,
            "act": step_memory(plain_step, model)["act"]}


def test_profile_leaves_the_model_as_it_was() -> None:
    model = small_gpt(n_layer=2)
    batch = gpt_batch(model)
    apply_checkpointing(model, layers="blocks.1")
    profile(model, ["blocks.0", "blocks.1"], lambda: model.loss(batch))
    assert wrapped_modules(model) == ["blocks.1"]
    assert "forward" not in model.blocks[0].__dict__
    assert all(p.grad is None for p in model.parameters())


def test_profile_measures_what_the_package_measures(gpt: dict) -> None:
    """Kept bytes match saved_bytes under each option; recompute FLOPs add up to the step's."""
    model, batch, prof = gpt["model"], gpt["batch"], gpt["profile"]
    forward = lambda: model.loss(batch)  # noqa: E731
    assert prof.no_ckpt_peak == gpt["act"]  # our timeline's peak is MemTracker's act peak
    plain_flops = step_flops(lambda: model.loss(batch).backward())
    with FlopCounterMode(display=False) as counter:
        forward()
    block_flops = [sum(counter.get_flop_counts()[f"GPT.{n}"].values()) for n in BLOCKS]
    # A GPT block's attention is a batched matmul: selective_nb keeps less than selective, more than full.
    assert all(set(layer.options) == set(OPTIONS) for layer in prof.layers)
    for option in OPTIONS:
        how = _treatment(option)
        for name in BLOCKS:
            if how is not None:
                module = model.get_submodule(name)
                module.__dict__["forward"] = CheckpointedForward(module, how)
        saved = saved_bytes(model, forward, BLOCKS)
        # The rest keeps the same whatever the blocks do; the token ids come from outside the step,
        # so MemTracker (and the profile) do not count them as activations.
        assert prof.rest_bytes == saved.by_owner[REST] - batch[0].untyped_storage().nbytes()
        extra = step_flops(lambda: model.loss(batch).backward()) - plain_flops
        remove_checkpointing(model)
        model.zero_grad(set_to_none=True)
        assert [layer.options[option].kept_bytes for layer in prof.layers] == [saved.by_owner[n] for n in BLOCKS]
        assert sum(layer.options[option].recompute_flops for layer in prof.layers) == extra
    # Full recomputation replays each block's forward; checkpointing keeps only its input.
    assert [layer.options[FULL].recompute_flops for layer in prof.layers] == block_flops
    assert {layer.options[FULL].kept_bytes for layer in prof.layers} == {batch[0].numel() * 64 * 8}


def test_plan_is_optimal_on_the_gpt_profile(gpt: dict) -> None:
    prof = gpt["profile"]
    peaks = sorted({peak for peak, _, _ in _all_choices(prof.layers, prof.rest_bytes, prof.rest_running)})
    budgets = [int(f * gpt["act"]) for f in (0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)]
    budgets += random.Random(0).sample(peaks, 20) + [peaks[0] - 1, peaks[0]]
    assert _check_against_exhaustive(prof.layers, prof.rest_bytes, prof.rest_running, budgets) == len(budgets) - 2


def test_more_budget_never_costs_more_recompute(gpt: dict) -> None:
    prof = gpt["profile"]
    flops = [prof.plan(int(f / 20 * gpt["act"])).recompute_flops for f in range(5, 21)]
    assert flops == sorted(flops, reverse=True) and flops[0] > 0 == flops[-1]


def test_an_unreachable_budget_names_the_smallest_peak(gpt: dict) -> None:
    prof = gpt["profile"]
    smallest = min(peak for peak, _, _ in _all_choices(prof.layers, prof.rest_bytes, prof.rest_running))
    budget = int(0.1 * gpt["act"])
    with pytest.raises(ConfigError) as refused:
        prof.plan(budget)
    problem = refused.value.problems[0]
    assert (problem.key, problem.value, problem.least) == ("ckpt.budget", budget, smallest)


def test_nothing_to_choose_from() -> None:
    with pytest.raises(ValueError, match="ckpt=auto: nothing to choose from: ckpt.layers selected no layers"):
        plan([], 0, 10**9)
    model = small_gpt(n_layer=2)
    with pytest.raises(ValueError, match="ckpt=auto: nothing to choose from: ckpt.layers selected no layers"):
        profile(model, [], lambda: model.loss(gpt_batch(model)))


def test_candidates_must_exist_and_not_nest() -> None:
    model = small_gpt(n_layer=2)
    forward = lambda: model.loss(gpt_batch(model))  # noqa: E731
    with pytest.raises(ValueError, match="ckpt.layers selected 'blocks.0.attn' inside 'blocks.0'"):
        profile(model, ["blocks.0", "blocks.0.attn"], forward)
    with pytest.raises(ValueError, match="no module named 'blocks.7'"):
        profile(model, ["blocks.7"], forward)


def test_the_plan_reads_as_a_table(gpt: dict) -> None:
    p = gpt["profile"].plan(int(0.5 * gpt["act"]))
    text = str(p)
    for name, option in p.choices.items():
        assert any(line.split()[:2] == [name, str(option)] for line in text.splitlines())
    assert f"{p.recompute_flops:,}" in text and f"({p.budget_bytes} B)" in text and "(rest of model)" in text


def _treatment(option: Option) -> Treatment | None:
    return {
        KEEP: None,
        SELECTIVE: Treatment(policy=make_policy("matmuls")),
        SELECTIVE_NB: Treatment(policy=make_policy("matmuls_no_batch")),
        FULL: Treatment(checkpointing=True),
    }[option]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_the_plan_fits_the_budget_for_real(gpt: dict, fraction: float) -> None:
    """Applied to the model, the plan's MemTracker act peak is within budget; gradients bitwise equal."""
    model, prof = gpt["model"], gpt["profile"]
    budget = resolve(parse_budget(fraction), gpt["act"])
    p = plan(prof.layers, prof.rest_bytes, budget, rest_running=prof.rest_running)
    assert set(p.choices.values()) != {KEEP}
    for name, option in p.choices.items():
        how = _treatment(option)
        if how is not None:
            module = model.get_submodule(name)
            module.__dict__["forward"] = CheckpointedForward(module, how)
    try:
        def step() -> None:
            gpt["step"]()
            model.zero_grad(set_to_none=True)

        act = step_memory(step, model)["act"]
        torch.manual_seed(0)
        gpt["step"]()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        remove_checkpointing(model)
        model.zero_grad(set_to_none=True)
    print(f"budget {fraction}: {budget} B, predicted {p.predicted_peak} B, MemTracker act {act} B, {p.choices}")
    # The peak model is exact on this chain, up to the bytes two layers keep (counted twice).
    assert 0.99 * act <= p.predicted_peak <= min(budget, 1.05 * act)
    assert all(torch.equal(grads[n], g) for n, g in gpt["grads"].items())


@pytest.mark.parametrize("fraction", [0.7, 0.8, 0.9])
def test_the_resnet_plan_predicts_its_peak_within_5_percent(fraction: float) -> None:
    """BatchNorm, a stem among the candidates, downsampling blocks: predicted within 5 % of MemTracker's act peak."""
    model = small_resnet(channels=32, depths=(2, 2), image_size=16, batch_size=8)
    batch = resnet_batch(model, batch=8)
    names = ["stem"] + [n for n, m in model.named_modules() if type(m).__name__ == "Bottleneck"]

    def step() -> None:
        model.loss(batch).backward()
        model.zero_grad(set_to_none=True)

    prof = profile(model, names, lambda: model.loss(batch))
    # Convolutions are no matmul without a batch dimension: selective_nb would keep what full keeps; not offered.
    assert all(set(layer.options) == {KEEP, SELECTIVE, FULL} for layer in prof.layers)
    budget = int(fraction * prof.no_ckpt_peak)
    p = prof.plan(budget)
    install(model, wrap_plan(p))
    try:
        step()
        act = step_memory(step, model)["act"]
    finally:
        remove_checkpointing(model)
    assert set(p.choices.values()) != {KEEP}
    assert 0.99 * act <= p.predicted_peak <= min(budget, 1.05 * act), (p.predicted_peak, act, p.choices)


def test_the_summary_says_how_options_were_timed_even_without_a_predicted_ratio() -> None:
    """On a loaded machine the step without checkpointing, predicted from timings, can come out <= 0:
    the summary still says the options were chosen by timings, and how they were taken."""
    layers = [LayerProfile("layers.0", {KEEP: Cost(40, 0, 10, seconds=0.0), FULL: Cost(4, 9, 30, seconds=0.002)})]
    timed = Profile(layers, 0, 0, no_ckpt_peak=100, none_seconds=0.0, timed_as="eager").plan(35)
    assert timed.choices == {"layers.0": FULL} and timed.predicted_time_ratio is None
    assert ("options chosen by added step time (+2.0 ms of recomputation, measured layer by layer, eager); the step "
            "without checkpointing could not be predicted from these timings, so no ratio") in str(timed)
    ratio = Profile(layers, 0, 0, no_ckpt_peak=100, none_seconds=0.01, timed_as="eager").plan(35)
    assert "predicted step time 1.20x that without checkpointing (+2.0 ms of recomputation, measured layer by " \
           "layer, eager)" in str(ratio)


# ---------------------------------------------------------------------- a saved output written after its layer

class _Project(torch.nn.Module):
    """Ends in a linear layer: ``selective`` saves the matmul whose output it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.v = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 8) -> (B, T, 8)
        return self.v(torch.tanh(x))


class _Scores(_Project):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # elementwise ops between the matmuls: selective keeps less
        return x + torch.bmm(torch.bmm(x, x.transpose(1, 2)).softmax(-1).exp().sigmoid(), torch.tanh(self.v(x)).exp())


class _Scaled(torch.nn.Module):
    """Scales what each ``_Project`` returns in place: the output ``selective`` saved there, after its region."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Project(), _Scores(), _Project(), _Scores()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i % 2 == 0:
                x.mul_(1.5)
        return x


def _scaled() -> _Scaled:
    torch.manual_seed(0)
    return _Scaled()


X = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model(X).pow(2).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_auto_leaves_out_a_selective_option_a_layer_cannot_run_under() -> None:
    """``selective`` on ``_Project`` saves the matmul output its parent then scales in place: asked for by name, it
    is an error naming the layer; ``ckpt=auto`` profiles those layers without it (the others keep it), and its
    plans train bitwise as without checkpointing."""
    from ckpt_plugin.apply.install import apply_config
    from ckpt_plugin.config.schema import make_config
    from ckpt_plugin.engine.selective.policies import SavedOutputModified

    layers = [f"blocks.{i}" for i in range(4)]
    model = _scaled()
    apply_checkpointing(model, layers=layers, mode="selective")
    with pytest.raises(SavedOutputModified, match=(
            r"^selective checkpointing of blocks.2 saved the output of aten.\w+.default and it was then modified in "
            r"place")):
        _grads(model)  # backward reaches blocks.2 first

    model = _scaled()
    prof = profile(model, layers, lambda: model(X).pow(2).sum())
    assert {layer.name: sorted(map(str, layer.options)) for layer in prof.layers} == {
        "blocks.0": ["full", "keep"], "blocks.1": ["full", "keep", "selective", "selective_nb"],
        "blocks.2": ["full", "keep"], "blocks.3": ["full", "keep", "selective", "selective_nb"]}
    plain = _grads(_scaled())
    for budget in ("min", 0.7):
        model = _scaled()
        assert apply_config(model, make_config(layers=layers, mode="auto", budget=budget),
                            forward=lambda: model(X).pow(2).sum())
        got = _grads(model)
        assert all(torch.equal(got[n], plain[n]) for n in plain), budget


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Project(), _Scores()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(1.5)  # inside the pair's region: selective on the pair copies it first; after a's region
        return self.b(h)


def test_parts_that_cannot_run_selective_leave_the_others_candidates_inside_their_layer() -> None:
    """One level down the same: the part whose saved output is written after it returns is profiled without
    ``selective``, its sibling with it, and ``min`` plans inside the layers, bitwise. The layer itself, whose
    own region holds the write, runs ``selective`` (the output is copied before it is written)."""
    from ckpt_plugin.apply.install import apply_config
    from ckpt_plugin.config.schema import make_config

    def pairs() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(_Pair(), _Pair())

    model = pairs()
    prof = profile(model, ["0", "1"], lambda: model(X).pow(2).sum(), depth=1)
    for layer in prof.layers:  # options inside it, and selective of its own
        assert any(o.kind == INSIDE for o in layer.options) and SELECTIVE in layer.options, layer
    assert {name: sorted(map(str, options)) for name, options in prof.parts.items()} == {
        "0.a": ["full", "keep"], "0.b": ["full", "keep", "selective"],
        "1.a": ["full", "keep"], "1.b": ["full", "keep", "selective"]}
    plain = _grads(pairs())
    for mode in ("selective", "auto"):
        model = pairs()
        apply_config(model, make_config(layers=["0", "1"], mode=mode, **({"budget": "min"} if mode == "auto" else {})),
                     forward=lambda: model(X).pow(2).sum())
        got = _grads(model)
        assert all(torch.equal(got[n], plain[n]) for n in plain), mode
