"""``ckpt.memory`` and ``ckpt.batch=max`` (issue #34): the whole step on fake tensors is the real one, byte for byte,
in every MemTracker category; the plan chosen for a limit holds its real step under it, as predicted; a limit no plan
meets is refused with the least memory and what takes it; the batch found is the largest whose real step fits."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
import warm_python

from ckpt_examples.gpt import GPT
from ckpt_examples.resnet import ResNet
from ckpt_plugin.apply.batch import Sample, largest_batch, largest_fitting
from ckpt_plugin.apply.install import install_plan
from ckpt_plugin.apply.memory import whole_of
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.apply.strategies import Measuring, least_of, strategies
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.whole_step import whole_step
from ckpt_plugin.units import format_bytes


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_embd=32, n_head=2, block_size=32, batch_size=4, dropout=0.0)


def _resnet() -> ResNet:
    torch.manual_seed(0)
    return ResNet(channels=8, depths=(1, 1), batch_size=2, dropout=0.0)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def _forward(model):
    return lambda: model(model.example_input_array)


def _real(model, plan: WrapPlan, optimizer: str):
    """The real whole step of a fresh copy of ``model`` with ``plan`` installed (MemTracker, every category)."""
    fresh = copy.deepcopy(model)
    install_plan(fresh, plan)
    return whole_step(fresh, _forward(fresh), [OPTIMIZERS[optimizer](fresh.parameters())], fake=False)


def _least(model, names, forward):
    chosen = least_of(strategies(Measuring(model, names, forward, {}, True, timed=False), eager=True))
    return chosen.strategy.installed(chosen.plan)


@pytest.mark.parametrize(("make", "layers", "optimizer"), [
    (_gpt, "TransformerBlock", "adamw"), (_resnet, "Bottleneck", "sgd")], ids=["gpt-adamw", "resnet-sgd"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["none", "full"])
def test_the_whole_step_on_fake_tensors_is_the_real_one(make, layers, optimizer, wrapped):
    model = make()
    plan = WrapPlan()
    if wrapped:
        plan = plan_for(model, make_config(layers=layers))
    fresh = copy.deepcopy(model)
    optimizer_of = OPTIMIZERS[optimizer](model.parameters())
    fake = whole_of(model, plan, _forward(model), [optimizer_of])
    # Nothing left behind: no gradient, no optimizer state, no wrapper.
    assert all(p.grad is None for p in model.parameters()) and not optimizer_of.state
    assert "forward" not in vars(model.blocks[0] if hasattr(model, "blocks") else model.stages[0][0])
    real = _real(fresh, plan, optimizer)
    assert fake.peak == real.peak
    assert fake.at_peak == real.at_peak  # parameters, gradients, optimizer, activations, temporaries at the peak
    assert fake.peaks == real.peaks  # and each category's own peak over the step
    assert real.at_peak["optstate"] > 0 and real.at_peak["parameter"] > 0


def test_a_contained_step_costs_what_the_step_costs():
    """Putting the module's state back (``measure/contained.py``) copies its tensor attributes before the step; no
    measurement of the step may count those copies (the example GPT's ``example_input_array``, 1,024 B, was once
    predicted on top of every step). An EMA written in place is put back, by the copy no tracker saw."""
    from ckpt_plugin.measure.contained import contained

    model = _gpt()
    model.ema = torch.zeros(64, 1024)  # 256 KiB written in place by the step

    def step():
        model.ema.add_(1.0)
        return model(model.example_input_array)

    def step_contained():
        with contained(model):
            return step()

    plain = whole_step(model, step, [OPTIMIZERS["adamw"](model.parameters())])
    model.ema.zero_()
    kept = whole_step(model, step_contained, [OPTIMIZERS["adamw"](model.parameters())])
    assert (kept.peak, kept.at_peak) == (plain.peak, plain.at_peak)
    assert torch.equal(model.ema, torch.zeros(64, 1024))


def test_gradients_of_the_step_before_are_alive_while_the_forward_runs():
    """Lightning zeroes the gradients after training_step, before backward: the forward of every step but the
    first runs beside a full set of gradients. Without checkpointing the GPT's step peaks at the end of its
    forward, so every gradient is in its peak."""
    model = _gpt()
    split = whole_step(model, _forward(model), [OPTIMIZERS["adamw"](model.parameters())])
    assert split.at_peak["gradient"] == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_the_plan_for_a_limit_holds_its_real_step_under_it_as_predicted(fraction):
    model = _gpt()
    names = [f"blocks.{i}" for i in range(2)]
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    without = whole_of(model, WrapPlan(), _forward(model), [optimizer]).peak
    least = whole_of(model, _least(model, names, _forward(model)), _forward(model), [optimizer]).peak
    limit = least + int(fraction * (without - least))
    plan = plan_for(model, make_config(mode="auto", layers="TransformerBlock", memory=limit, timing="eager"),
                    _forward(model), optimizers=[optimizer])
    real = _real(model, plan, "adamw")
    assert plan.names, "a limit under the step without checkpointing wraps something"
    assert real.peak <= limit
    assert plan.fit.split.peak == real.peak  # predicted exactly (the issue asks within 2 %)
    assert plan.fit.split.at_peak == real.at_peak
    assert plan.summary.startswith(f"ckpt.memory={limit} ")
    assert f"predicted whole-step peak {plan.fit.split}" in plan.summary


def test_planning_for_a_limit_measures_each_plans_peak_once(monkeypatch):
    """The strategies check the same plan more than once (ckpt.memory's least plan, then the budgets bisected):
    each check is a whole recorded step on fake tensors, so a plan's peak is measured once and read back."""
    import ckpt_plugin.planning.profile as profile

    measured: list[tuple] = []
    real_peak = profile._plan_peak

    def counted(model, forward, choices, fake, grouped=()):
        measured.append((tuple(choices.items()), grouped, fake))
        return real_peak(model, forward, choices, fake, grouped)

    monkeypatch.setattr(profile, "_plan_peak", counted)
    model = _gpt()
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    without = whole_of(model, WrapPlan(), _forward(model), [optimizer]).peak
    plan = plan_for(model, make_config(mode="auto", layers="TransformerBlock", memory=without - 1, timing="eager"),
                    _forward(model), optimizers=[optimizer])
    assert plan.names and measured  # it planned, and checked plans' peaks
    assert len(measured) == len(set(measured)), measured


def test_a_limit_that_holds_the_step_wraps_nothing_and_says_so():
    model = _resnet()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    without = whole_of(model, WrapPlan(), _forward(model), [optimizer]).peak
    plan = plan_for(model, make_config(mode="auto", layers="Bottleneck", memory=without), _forward(model),
                    optimizers=[optimizer])
    assert plan.names == [] and plan.fit.split.peak == without
    assert f"ckpt.memory={without} holds the whole step without checkpointing: every layer is kept" in plan.summary


def test_a_limit_no_plan_meets_names_the_least_memory_and_what_takes_it():
    model = _resnet()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    least_plan = _least(model, ["stages.0.0", "stages.1.0"], _forward(model))
    least = _real(model, least_plan, "sgd")
    with pytest.raises(ConfigError) as caught:
        plan_for(model, make_config(mode="auto", layers="Bottleneck", memory=least.peak - 1), _forward(model),
                 optimizers=[optimizer])
    (problem,) = caught.value.problems
    assert problem.key == "ckpt.memory" and problem.least == least.peak
    assert str(problem).startswith(
        f"ckpt.memory: {format_bytes(least.peak - 1)} ({least.peak - 1} B) cannot hold the whole step: the least whole-step peak any checkpointing "
        f"of ckpt.layers reaches is {least}; without checkpointing ")
    assert str(problem).endswith(f"raise ckpt.memory to at least {least.peak}B, select more layers, shard the "
                                 "parameters, gradients and optimizer state (FSDP, DeepSpeed ZeRO), or lower the "
                                 "batch size")


def _curve(base: int, slope: int, bumps: list[int], b: int) -> int:
    return base + slope * b + bumps[b]


def test_the_largest_fitting_size_is_exact_whatever_the_curve():
    rng = random.Random(0)
    for _ in range(500):
        base, slope, bound = rng.randrange(10**6), rng.randrange(1, 10**4), rng.choice([1, 7, 100, 4096])
        bumps = [rng.randrange(slope) for _ in range(bound + 2)]  # a plan that changes with the batch: not affine
        peak = functools.partial(_curve, base, slope, bumps)  # still growing with b
        limit = rng.randrange(base + slope * 2 * bound)
        want = max((b for b in range(1, bound + 1) if peak(b) <= limit), default=0)
        assert largest_fitting(peak, rng.randrange(1, 64), bound, limit) == want


def test_the_batch_found_is_the_largest_whose_real_step_fits():
    model = _gpt()
    names = [f"blocks.{i}" for i in range(2)]
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    x = model.example_input_array
    sample = Sample(((x,), {}), lambda *a, **k: model(*a, **k), (x, x.clone()), model.loss)
    found = largest_batch(model, names, sample, 3 * 2**20, [optimizer], bound=4096)
    assert found.batch > x.shape[0]

    def real(batch: int):  # the least plan at ``batch``, a real step of the training loss at that batch
        plan = _least(model, names, sample.forward(batch))  # planned on fake tensors, as the search did
        fresh = copy.deepcopy(model)
        install_plan(fresh, plan)
        rows = torch.randint(96, (batch, 32))
        step = whole_step(fresh, lambda: fresh.loss((rows, rows)), [OPTIMIZERS["adamw"](fresh.parameters())],
                          fake=False)
        return step.holding((sample.held(batch),)).peak  # the batch, made before the step, on the device

    assert real(found.batch) == found.least.peak <= 3 * 2**20
    assert real(found.batch + 1) == found.above.peak > 3 * 2**20


@pytest.mark.parametrize("precision", ["bf16-mixed"])  # 32-true: tests/fit_ddp_worker.py, and the recipe (test_docs)
def test_batch_max_under_a_trainer_sets_the_loader_and_the_step_it_measures_fits(tmp_path, caplog, precision):
    import lightning.pytorch as pl

    from ckpt_examples.data import TextData
    from ckpt_plugin import ActivationCheckpointing

    model = _gpt()
    data = TextData(block_size=32, batch_size=4, num_samples=256)
    callback = ActivationCheckpointing(mode="auto", layers="TransformerBlock", memory="3MiB", batch="max")
    seen: list[int] = []

    class Sizes(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch[0].shape[0])

    trainer = pl.Trainer(max_steps=3, callbacks=[callback, Sizes()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=tmp_path, precision=precision)
    with caplog.at_level("INFO"):
        trainer.fit(model, data)
    batch = callback.batch_size
    assert batch > 4 and data.batch_size == batch == model.hparams.batch_size  # where BatchSizeFinder writes it
    assert seen == [batch] * 3  # the loader was built again at that size
    predicted, measured = callback.step_watch.predicted, callback.step_watch.measured
    assert measured.peak <= 3 * 2**20
    assert abs(measured.peak - predicted.peak) <= 0.02 * predicted.peak
    # Parameters and gradients at the peak are the ones predicted, to the byte; Lightning's loop adds a few
    # scalars of its own around the step (measured: 8 B in all, 4 of them while the optimizer steps).
    for category in ("parameter", "gradient"):
        assert measured.at_peak[category] == predicted.at_peak[category]
    assert 0 <= measured.peak - predicted.peak <= 64
    said = caplog.text
    assert f"ckpt.batch=max: {batch} samples per micro-batch (the sample had 4)" in said
    assert "ckpt.memory: the whole step measured at the second batch (MemTracker): " in said


def test_under_ddp_rank_zero_plans_the_batch_and_every_rank_fits_with_the_buckets_counted(tmp_path):
    """Two DDP ranks (gloo, CPU; tests/fit_ddp_worker.py): one batch and one plan on both, the reducer's
    gradient buckets counted in the prediction, and each rank's measured step under the limit as predicted."""
    import json
    import os
    from pathlib import Path

    worker = Path(__file__).with_name("fit_ddp_worker.py")
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = warm_python.run_ranks([str(worker), str(tmp_path / "run")], 2, env=env, cwd=tmp_path, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    zero, one = (json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in range(2))
    assert zero["world_size"] == 2 and zero["batch"] == one["batch"] > 4
    assert zero["seen"] == one["seen"] == [zero["batch"]] * 3 and zero["data_batch"] == zero["batch"]
    assert zero["wrapped"] == one["wrapped"] and zero["wrapped"]
    for rank in (zero, one):
        assert rank["measured"] <= rank["limit"]
        assert 0 <= rank["measured"] - rank["predicted"] <= 64  # Lightning's own scalars (8 B measured)
    assert "DDP's gradient buckets 127.5 KiB" in output
