"""What the modules outside ``ckpt.layers`` keep (``measure/outside.py``): which "more layers" to select.

The example ResNet is the case: with its ``Bottleneck``s alone as candidates,
``ckpt=auto`` cannot checkpoint the stem, which runs at full resolution. The
modules found, their bytes (derived from shapes), and through ``ckpt=auto``:
a refused budget names the stem, and selecting it as named reaches lower.
"""

from __future__ import annotations

import pytest
import torch
from conftest import resnet_batch, small_gpt, small_resnet

from ckpt_plugin import remove_checkpointing
from ckpt_plugin.apply.install import install_plan
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.selection import select_layers
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.memory import step_memory
from ckpt_plugin.measure.outside import outside, outside_keepers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def resnet() -> dict:
    model = small_resnet()
    model.train()
    batch = resnet_batch(model)
    return {"model": model, "batch": batch, "forward": lambda: model.loss(batch),
            "blocks": select_layers(model, "Bottleneck")}


def test_the_modules_outside_hold_no_candidate_and_a_module_list_is_looked_into(resnet: dict) -> None:
    assert outside(resnet["model"], resnet["blocks"]) == ["stem", "fc"]  # stages holds blocks: looked into
    gpt = small_gpt()
    found = outside(gpt, ["blocks.0", "blocks.1"])
    # The ModuleList is never called: its unselected blocks are measured one by one.
    expected = [n for n, _ in gpt.named_modules() if n.count(".") == 0 and n not in ("", "blocks")]
    assert set(found) == {*expected, "blocks.2", "blocks.3"}
    order = [n for n, _ in gpt.named_modules()]
    assert found == sorted(found, key=order.index)


def test_what_each_keeps_beyond_its_inputs(resnet: dict) -> None:
    """The stem (conv, BatchNorm, ReLU) keeps BatchNorm's input, its mean and inverse std, and ReLU's output; its
    convolution keeps the image, its input, which checkpointing it would keep too. ``fc`` keeps only its input."""
    model, (x, _) = resnet["model"], resnet["batch"]
    B, C, H, W = x.shape[0], model.hparams.channels, x.shape[2], x.shape[3]
    one = B * C * H * W * 4
    assert outside_keepers(model, resnet["blocks"], resnet["forward"]) == [("stem", 2 * one + 2 * C * 4)]


def test_a_refused_budget_names_the_stem_and_selecting_it_reaches_lower(resnet: dict) -> None:
    model, batch = resnet["model"], resnet["batch"]
    (_, stem), = outside_keepers(model, resnet["blocks"], resnet["forward"])
    plain = step_memory(lambda: (model.loss(batch).backward(), model.zero_grad(set_to_none=True)), model)["act"]
    least = plan_for(model, make_config(mode="auto", layers="Bottleneck", budget="min"), resnet["forward"])
    assert f"outside ckpt.layers, stem keeps {stem / 1024:.1f} KiB ({stem / plain:.2f} of the peak" in least.summary
    with pytest.raises(ConfigError) as refused:
        plan_for(model, make_config(mode="auto", layers="Bottleneck", budget=least.planned.predicted_peak - 1024),
                 resnet["forward"])
    message = str(refused.value)
    assert message.endswith(f"or select more layers. Outside ckpt.layers, stem keeps {stem / 1024:.1f} KiB "
                            f"({stem / plain:.2f} of the peak without checkpointing) beyond its inputs for backward, "
                            "whatever the plan: add it to ckpt.layers (a qualified name is an entry) for ckpt=auto "
                            "to checkpoint it too"), message
    # As the message says: its name is an entry. Each plan installed as planned (apply_config would plan again).
    with_stem = plan_for(model, make_config(mode="auto", layers=["Bottleneck", "stem"], budget="min"),
                         resnet["forward"])
    peaks = {}
    try:
        for name, plan in (("blocks", least), ("blocks and stem", with_stem)):
            install_plan(model, plan)
            peaks[name] = step_memory(
                lambda: (model.loss(batch).backward(), model.zero_grad(set_to_none=True)), model)["act"]
            remove_checkpointing(model)
    finally:
        remove_checkpointing(model)
    assert "stem" in with_stem.names and "stem" not in least.names
    assert peaks["blocks and stem"] < peaks["blocks"]
    # With the stem selected, what is left outside (fc: its input only) is not worth a line.
    assert "outside ckpt.layers" not in with_stem.summary


def test_measuring_leaves_the_model_as_it_was(resnet: dict) -> None:
    model = resnet["model"]
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    outside_keepers(model, resnet["blocks"], resnet["forward"])
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
