"""Issue #33, item 5: every list of wrapped names comes in the model's registration order
(``model.named_modules()``), whatever order the plan or the forward has them in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckpt_plugin import apply_checkpointing, make_config, remove_checkpointing, wrapped_modules
from ckpt_plugin.apply.install import install_plan
from ckpt_plugin.apply.plan import plan_for


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class TinyUNet(nn.Module):
    """As diffusers' UNet2DConditionModel: ``mid_block`` is registered after ``up_blocks`` but runs between."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.down_blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.up_blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.mid_block = Block(width)
        self.example_input_array = torch.randn(64, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        for block in self.up_blocks:
            x = block(x)
        return x


REGISTERED = ["down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1", "mid_block"]


@pytest.mark.parametrize("keys", [
    {"mode": "full"},
    {"mode": "selective", "policy": "matmuls"},
    {"mode": "offload"},
    {"mode": "auto", "budget": "min"},
], ids=lambda k: k["mode"])
def test_every_mode_returns_registration_order(keys: dict) -> None:
    torch.manual_seed(0)
    model = TinyUNet()
    assert [n for n, m in model.named_modules() if isinstance(m, Block)] == REGISTERED
    wrapped = apply_checkpointing(model, layers="Block", **keys)
    assert wrapped == REGISTERED
    assert wrapped_modules(model) == REGISTERED
    if keys["mode"] != "auto":  # auto's plan: the test below (planning twice would double this test's time)
        assert install_plan(model, plan_for(model, make_config(layers="Block", **keys))).names == REGISTERED
    assert remove_checkpointing(model) == REGISTERED


def test_auto_plan_lists_as_run_but_returns_as_registered() -> None:
    """The plan keeps the order the layers run in (the planner's chain); only the returned names are sorted."""
    torch.manual_seed(0)
    model = TinyUNet()
    plan = plan_for(model, make_config(mode="auto", layers="Block", budget="min"))
    assert list(plan.planned.choices) == ["down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1"]
    assert install_plan(model, plan).names == REGISTERED
