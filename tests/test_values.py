"""Forwards that read values are measured and planned on fake tensors (``measure/values.py``, issue #33 point 1).

Each forward here reads what fake tensors do not carry: a branch on ``.item()``,
a boolean mask as an index (whose backward reads the mask again), ``nonzero``
per expert in a loop (a different count per layer and per expert). The fake
measurements replay what one forward without autograd read, so their bytes are
the real step's, exactly; ``ckpt=auto`` plans such models and the planned step
is bitwise the plain one. A read the recording cannot answer is a ConfigError
naming the op, the module and the fixed modes that work.
"""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_plugin import ActivationCheckpointing, apply_checkpointing
from ckpt_plugin._compat import is_fake
from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.wrap import checkpointing_disabled, remove_checkpointing
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.report import measure_step
from ckpt_plugin.measure.values import record_values, recorded_values
from ckpt_plugin.units import format_bytes


class Routed(nn.Module):
    """A mixture of experts as Hugging Face's eager MoE layers run it: a loop over the experts that got tokens,
    each finding its tokens with ``nonzero``; a padding check reads a value first."""

    def __init__(self, width: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        if not pad.any():  # a read: a branch on data
            pad = None
        weights = self.router(x).softmax(-1)
        choice = weights.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == e).squeeze(-1)  # a read: how many tokens this expert got
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, e, None])
        if pad is not None:
            out = out.masked_fill(pad[:, None], 0.0)
        kept = out[~pad] if pad is not None else out  # a boolean mask as an index: its backward reads it again
        return x + kept.sum() / kept.shape[0]


class Stack(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Routed() for _ in range(depth))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, pad)
        return x


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    pad = torch.zeros(24, dtype=torch.bool)
    pad[-5:] = True
    return torch.randn(24, 8), pad


def _step(model: nn.Module) -> list[torch.Tensor]:
    x, pad = _batch()
    model(x, pad).pow(2).mean().backward()
    grads = [torch.zeros(0) if p.grad is None else p.grad.clone() for p in model.parameters()]  # an idle expert
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_the_fake_step_of_a_routed_forward_counts_what_the_real_one_keeps(mode: str) -> None:
    model = Stack()
    x, pad = _batch()
    names = apply_checkpointing(model, layers="Routed", mode=mode) if mode != "none" else ["layers.0", "layers.1",
                                                                                           "layers.2"]
    fake, real = (measure_step(model, lambda: model(x, pad), names, fake=f) for f in (True, False))
    assert fake.kept.by_owner == real.kept.by_owner and fake.kept.total > 0
    assert fake.peaks == real.peaks


def test_the_recording_runs_only_where_a_read_needs_it_and_leaves_no_trace() -> None:
    model = Stack()
    x, pad = _batch()
    plain = nn.Sequential(nn.Linear(8, 8))
    measure_step(plain, lambda: plain(x), ["0"])
    assert recorded_values(plain) is None  # a value-free forward never runs for real
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with checkpointing_disabled(model):
        measured = measure_step(model, lambda: model(x, pad), ["layers.0"])
    record = recorded_values(model)
    assert record is not None and record.reads == 3 * (1 + 3 * 3 + 1)  # per layer: the check; per expert nonzero, x[rows], weights[rows]; x[mask]
    assert 0 < record.peak_bytes < measured.activation_peak  # no activation kept for backward
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items()) and torch.equal(rng, torch.get_rng_state())
    assert record_values(model, lambda: model(x, pad)).answers == record.answers  # the same calls, the same answers


@pytest.mark.parametrize("budget", ["min"])  # its parts measured too; 0.8 under a Trainer below
def test_auto_plans_a_routed_forward_and_the_step_stays_bitwise(budget: str) -> None:
    model, plain = Stack(), Stack()
    x, pad = _batch()
    wrapped = apply_config(model, make_config(mode="auto", layers="Routed", budget=budget),
                           lambda: model(x, pad).pow(2).mean())
    assert wrapped
    steps = _step(plain), _step(model)
    assert all(torch.equal(a, b) for a, b in zip(*steps, strict=True)) and any(g.numel() for g in steps[1])
    remove_checkpointing(model)


class ReadsInBackward(torch.autograd.Function):
    """A custom backward that reads a value (a gradient's norm, as clipping does): no forward makes that read."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2 if grad.abs().max().item() < 1e6 else grad


class Clipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(ReadsInBackward.apply(self.a(x)))


def test_a_read_no_forward_makes_is_a_config_error_naming_the_op_the_module_and_what_works() -> None:
    model = nn.Sequential(Clipped(), Clipped())
    with pytest.raises(ConfigError) as caught:
        apply_config(model, make_config(mode="auto", layers="Clipped", budget=0.5), lambda: model(torch.ones(2, 4)).sum())
    message = str(caught.value)
    assert caught.value.keys == ["ckpt.mode"]
    assert re.search(r"ckpt=auto's profile runs Sequential on fake tensors \(shapes only, no memory\) and its forward "
                     r"cannot run on them: UnreplayableRead: aten\._local_scalar_dense\.default in backward in the "
                     r"model's top level \(.*test_values\.py:\d+, inputs \[\(\)\]\) reads values, and the forward run "
                     r"without autograd never made that call; a fixed mode needs no measurement: ckpt=full, selective "
                     r"or offload with the same ckpt.layers", message), message
    assert apply_checkpointing(model, layers="Clipped") == ["0", "1"]  # what the message says works, works


class RoutedModule(LightningModule):
    """The routed stack in a LightningModule with a sample input: the callback plans and reports from it."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack()
        self.example_input_array = _batch()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.stack(x, pad)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, pad = batch
        return self(x, pad).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_trainer_plans_and_reports_a_forward_that_reads_values(tmp_path, caplog) -> None:
    x, pad = _batch()
    model = RoutedModule()
    callback = ActivationCheckpointing(mode="auto", layers="Routed", budget="0.8")
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                      callbacks=[callback])
    with caplog.at_level("INFO"):
        trainer.fit(model, DataLoader(TensorDataset(x[None], pad[None]), batch_size=None))
    out = caplog.text + str(callback.report)
    record = recorded_values(model)
    assert record is not None and record.reads == 3 * (1 + 3 * 3 + 1)
    said = ("the forward reads values (33 reads): one forward without autograd recorded them (its peak "
            f"{format_bytes(record.peak_bytes)} beside the parameters), and the measurements on fake tensors "
            "replayed them")
    assert out.count(said) >= 2, out  # under the plan, and in the report
    assert callback.report.values is record and callback.report.peaks[1] <= callback.planned.budget_bytes
    assert callback.wrapped  # (taken off again when the fit ends)


def test_lightnings_demo_transformer_plans_and_keeps_no_fake_tensor() -> None:
    """Lightning's demo ``Transformer`` reads a value (torch's causal-mask check, ``torch.equal``) and fills its
    positional table lazily (``PositionalEncoding.pe``, a plain attribute): the first fake run, stopped at the read,
    had left ``pe`` fake, and the next real step computed on it. Measurements put such attributes back."""
    from ckpt_tools.zoo import all_models
    from ckpt_tools.zoo.measure import _differences, _train

    entry = next(e for e in all_models() if e.name == "lightning.demo_transformer")
    model = entry.build()
    assert apply_config(model, make_config(layers="auto", mode="auto", budget=0.9),
                        forward=lambda: entry.loss(model(**entry.batch())))
    assert not any(is_fake(v) for m in model.modules() for v in vars(m).values())
    assert _differences(_train(entry, entry.build()), _train(entry, model)) == []
