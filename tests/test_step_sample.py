"""The unit of planning is the step the trainer runs (issue #42): ``training_step`` as written, on the first batch.

Modules written as much Lightning code is: ``training_step`` calling a child (``self.net``), no ``forward`` and no
``example_input_array``, their own ``train_dataloader()``; a loss that reads values (a guard on ``.item()``); a
``training_step`` that counts, appends, logs and draws random numbers. Every mode measures the step (the report,
the over-keeping check, ``ckpt=auto``'s profile and timing, ``ckpt.memory``'s whole step), and no run of it is one
the module can see: its counts equal the trainer's steps, its random stream is the run's without the plugin.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_plugin import ActivationCheckpointing

WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, WIDTH, generator=g), torch.randn(64, 1, generator=g))


class ChildNet(LightningModule):
    """``training_step`` calls ``self.net`` and ``self.loss_fn``; no forward, no sample; its own loader."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*(Block() for _ in range(4)), nn.Linear(WIDTH, 1))
        self.loss_fn = nn.MSELoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class GuardedLoss(ChildNet):
    """A loss that reads values, as Dice and focal losses and NaN guards do: a branch on ``.item()``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = self.loss_fn(out, y)
        if loss.item() > 1e6:  # a guard a fake tensor cannot answer: replayed from one recorded step
            loss = loss * 0.0
        mask = y > 0  # an ignore mask, read as an index
        return loss + (out[mask] - y[mask]).abs().mean()


class Counting(ChildNet):
    """A ``training_step`` with effects a user sees: it counts, appends, logs and draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.history: list[torch.Tensor] = []
        self.drawn: list[torch.Tensor] = []
        self.ema = torch.zeros(())

    def training_step(self, batch, batch_idx):
        self.calls += 1
        self.drawn.append(torch.randint(0, 1_000_000, (2,)))
        x, y = batch
        x = x + 0.01 * torch.randn_like(x)  # an augmentation: the stream every run must see alike
        loss = self.loss_fn(self.net(x), y)
        self.history.append(loss.detach())
        self.ema.mul_(0.9).add_(0.1 * loss.detach())  # a tensor attribute written in place
        self.log("calls", float(self.calls))
        return loss


def _fit(model: LightningModule, callback: ActivationCheckpointing | None, tmp_path, steps: int = 3) -> Trainer:
    torch.manual_seed(7)
    trainer = Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[callback] if callback is not None else [])
    trainer.fit(model)
    return trainer


MODES = {
    "full": {"mode": "full"},
    "selective": {"mode": "selective"},
    "offload": {"mode": "offload"},
    "auto": {"mode": "auto", "budget": 0.5},
    "memory": {"mode": "auto", "memory": "2MiB"},
}


@pytest.mark.parametrize("mode", MODES)
def test_measuring_runs_nothing_the_module_can_see(mode: str, tmp_path) -> None:
    """Under every mode, the counts equal the trainer's steps, the histories hold one entry per step, the random
    draws and the parameters are those of the run without the plugin, bitwise, and what was logged is the step's."""
    plain = Counting()
    plain.load_state_dict(_initial())
    expected = _fit(plain, None, tmp_path / "plain")
    model = Counting()
    model.load_state_dict(_initial())
    trainer = _fit(model, ActivationCheckpointing(layers="Block", **MODES[mode]), tmp_path / mode)
    assert model.calls == trainer.global_step == expected.global_step == 3
    assert len(model.history) == len(model.drawn) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.drawn, plain.drawn, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.history, plain.history, strict=True))
    assert torch.equal(model.ema, plain.ema)
    assert trainer.callback_metrics["calls"] == 3.0
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Counting().state_dict()


class WideNet(ChildNet):
    """ChildNet at a size where activations dominate the whole step: a limit between the least and none's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(*(WideBlock() for _ in range(4)), nn.Linear(2 * WIDTH, 1))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(512, 2 * WIDTH, generator=g), torch.randn(512, 1, generator=g)),
                          batch_size=256)


class WideBlock(Block):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.fc1, self.fc2 = nn.Linear(2 * WIDTH, 8 * WIDTH), nn.Linear(8 * WIDTH, 2 * WIDTH)


class WideGuarded(WideNet):
    training_step = GuardedLoss.training_step


def _none_whole_step(model: WideNet) -> int:
    """The whole step (AdamW, Lightning's order) without checkpointing, on fake tensors, as the user's step runs."""
    from ckpt_plugin.measure.whole_step import whole_step

    x, y = next(iter(model.train_dataloader()))
    return whole_step(model, lambda: model.training_step((x, y), 0),
                      [torch.optim.AdamW(model.parameters(), lr=1e-3)]).peak


@pytest.mark.parametrize("net", [WideNet, WideGuarded], ids=["child", "guarded-loss"])
def test_a_step_that_calls_a_child_plans_for_a_budget_and_for_a_memory(net, tmp_path, caplog) -> None:
    """No forward, no example_input_array, its own train_dataloader, the loss through self.loss_fn (and, guarded,
    read by .item() and masked): ckpt=auto plans the step for a budget (the child), and ckpt.memory plans its whole
    step (both), whose real peak at the second batch is under the limit and within 1 % of the prediction; both
    train."""
    if net is WideNet:
        with caplog.at_level("INFO"):
            budget = ActivationCheckpointing(mode="auto", layers="WideBlock", budget=0.5)
            _fit(net(), budget, tmp_path / "budget", steps=1)
        assert budget.wrapped and budget.planned.predicted_peak <= budget.planned.budget_bytes
        assert "ckpt: measuring runs training_step on the first training batch" in caplog.text
    none = _none_whole_step(net())
    limit = int(0.8 * none)
    memory = ActivationCheckpointing(mode="auto", layers="WideBlock", memory=limit)
    _fit(net(), memory, tmp_path / "memory")
    measured, predicted = memory.step_watch.measured.peak, memory.step_watch.predicted.peak
    assert memory.wrapped and measured <= limit, (measured, predicted, limit, memory.step_watch.measured, memory.step_watch.predicted)
    assert abs(measured - predicted) <= 0.01 * predicted, (measured, predicted)


def test_the_sample_goes_where_the_weights_are_while_lightning_says_the_strategy_s_device(tmp_path) -> None:
    """In the setup hook Lightning sets ``LightningModule.device`` to the strategy's device before the strategy has
    moved the module (``_call_setup_hook``): on a GPU under FSDP, cuda:0 with the weights still on the CPU, where
    ckpt=auto plans. The first batch goes where the weights are, or the planner's forward cannot run on it (the
    first GPU run's FSDP fit). Here the device Lightning names is ``meta``, as far from the weights as cuda:0."""
    from lightning.pytorch.callbacks import Callback

    from ckpt_plugin.lightning.sample import first_batch, sample_call

    seen: dict[str, torch.device] = {}

    class AsOnAGpu(Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            for module in pl_module.modules():
                module._device = torch.device("meta")  # what _call_setup_hook does with the strategy's device
            x, _ = first_batch(trainer, pl_module)
            pl_module.example_input_array = torch.zeros(2, WIDTH)
            (args, _kwargs) = sample_call(trainer, pl_module)
            seen.update(batch=x.device, example=args[0].device, said=pl_module.device)
            for module in pl_module.modules():
                module._device = torch.device("cpu")
            pl_module.example_input_array = None

    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, accelerator="cpu", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[AsOnAGpu()])
    trainer.fit(ChildNet())
    assert seen == {"batch": torch.device("cpu"), "example": torch.device("cpu"), "said": torch.device("meta")}
