"""The forward's own floor (``measure/floor.py``): an activation peak that no checkpointing goes below.

Checked as a lower bound must be: derived from shapes on the example ResNet
(what the call stack and one op hold), the same on fake and real tensors, at
most the measured act peak (MemTracker) of every plan of every mode tried, and
through ``ckpt=auto`` (issue #23's ResNet at 0.25): a budget below it is
refused saying no plan can meet it, one above it is not said to be out of reach.
"""

from __future__ import annotations

import pytest
import torch
from conftest import resnet_batch, small_resnet

from ckpt_plugin import apply_checkpointing, remove_checkpointing
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.wrap import install, wrapped_modules
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.floor import Floor, forward_floor
from ckpt_plugin.measure.memory import step_memory

pytestmark = pytest.mark.usefixtures("one_thread")

CANDIDATES = ["Bottleneck", "re:stem"]  # the bench's ckpt=auto candidates on the ResNet


@pytest.fixture(scope="module")
def resnet() -> dict:
    model = small_resnet()
    model.train()
    batch = resnet_batch(model)
    return {"model": model, "batch": batch, "forward": lambda: model.loss(batch)}


def _act_peak(model, batch) -> int:
    return step_memory(lambda: (model.loss(batch).backward(), model.zero_grad(set_to_none=True)), model)["act"]


def test_the_floor_is_what_the_call_stack_and_one_op_hold(resnet: dict) -> None:
    """Inside ``stages.0.1``'s dropout: ``stages`` (and ``stages.0``) hold the stem's output, ``stages.0.1``
    block 0's output, and the dropout's multiply reads bn3's output and the (B, C, 1, 1) noise and writes its
    own: four stage-0 activations and the noise, whatever is checkpointed."""
    model, (x, _) = resnet["model"], resnet["batch"]
    B, C, H, W = x.shape[0], model.hparams.channels, x.shape[2], x.shape[3]  # stage 0 keeps the resolution
    one = B * C * H * W * 4
    floor = forward_floor(model, resnet["forward"])
    assert floor == Floor(4 * one + B * C * 4, "stages.0.1.drop", "aten.mul")
    assert forward_floor(model, resnet["forward"], fake=False) == floor


def test_no_plan_of_any_mode_goes_below_the_floor(resnet: dict) -> None:
    model, batch = resnet["model"], resnet["batch"]
    floor = forward_floor(model, resnet["forward"]).bytes
    plans = [dict(mode="none"), dict(mode="full", layers=CANDIDATES), dict(mode="selective", layers="Bottleneck"),
             dict(mode="full", layers="Bottleneck", segments="recursive"),
             dict(mode="auto", layers=CANDIDATES, budget="min")]
    peaks = {}
    try:
        for keys in plans:
            install(model, plan_for(model, make_config(**keys), resnet["forward"]))
            peaks[keys["mode"] + str(keys.get("segments", ""))] = _act_peak(model, batch)
    finally:
        remove_checkpointing(model)
    assert min(peaks.values()) >= floor, (floor, peaks)
    assert peaks["auto"] < peaks["full"]  # and going inside the blocks comes closer to it than full on them


def test_a_budget_below_the_floor_is_refused_saying_no_plan_can(resnet: dict) -> None:
    """Issue #23's ResNet at 0.25: no schedule of any mode reaches it, and the refusal says so with the bytes;
    a budget above the floor that ckpt=auto still cannot meet is refused without that sentence."""
    model = resnet["model"]
    floor = forward_floor(model, resnet["forward"])
    with pytest.raises(ConfigError) as refused:
        plan_for(model, make_config(mode="auto", layers=CANDIDATES, budget=0.25), resnet["forward"])
    message = str(refused.value)
    assert message.startswith("ckpt.budget: ") and "cannot be met" in message
    assert (f"Nor can any other plan: no checkpointing of this model goes below "
            f"{floor.bytes / 1024:.1f} KiB ({floor.bytes} B, " in message), message
    assert f"while {floor.module} runs {floor.op}" in message
    least = refused.value.problems[0].least
    assert floor.bytes < least  # between the two: refused, but not said to be out of every plan's reach
    with pytest.raises(ConfigError) as between:
        plan_for(model, make_config(mode="auto", layers=CANDIDATES, budget=f"{floor.bytes}B"), resnet["forward"])
    assert "cannot be met" in str(between.value) and "Nor can any other plan" not in str(between.value)


def test_budget_min_says_how_low_any_plan_could_go(resnet: dict) -> None:
    model = resnet["model"]
    floor = forward_floor(model, resnet["forward"])
    plan = plan_for(model, make_config(mode="auto", layers=CANDIDATES, budget="min"), resnet["forward"])
    lines = plan.summary.splitlines()
    assert lines[1].startswith(f"ckpt.budget=min: no checkpointing of this model goes below "
                               f"{floor.bytes / 1024:.1f} KiB ({floor.bytes} B"), lines[:2]
    assert plan.planned.predicted_peak >= floor.bytes


def test_measuring_the_floor_leaves_the_model_as_it_was() -> None:
    model = small_resnet()
    batch = resnet_batch(model)
    wrapped = apply_checkpointing(model, layers="Bottleneck")
    try:
        before = {n: p.detach().clone() for n, p in model.state_dict().items()}
        forward_floor(model, lambda: model.loss(batch))
        assert wrapped_modules(model) == wrapped
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # BatchNorm statistics too
    finally:
        remove_checkpointing(model)
