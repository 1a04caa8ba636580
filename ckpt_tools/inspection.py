"""``ckpt-inspect``: what a ckpt config does to a model, measured on one step, before training.

    ckpt-inspect                                        # the embedded GPT, ckpt=full on TransformerBlock
    ckpt-inspect ckpt=selective
    ckpt-inspect model=resnet ckpt.layers=Bottleneck ckpt.segments=2

A Hydra app over ``ckpt_tools/configs/inspect.yaml``: the example ``model``/``data`` groups
(``ckpt_examples``) and the plugin's ``ckpt`` group, as ``recipes/train.py`` composes them. It builds the model
and one batch of its data, runs one training step (``training_step`` and
backward) without and with the config, and prints one row per selected module:
the activation bytes it keeps after the forward without and with the config
and the recompute FLOPs it adds, the totals, and the step's peak memory by
``MemTracker``'s categories. Nothing trains.

Every step runs on fake tensors (``ckpt_plugin/measure/fake.py``): shapes,
dtypes and storage sizes are the real ones, nothing is allocated and no kernel
runs, so a model can be inspected at a batch whose step without checkpointing
does not fit, for a few MiB, and every number is the one a real step gives
(``tests/test_inspection.py`` compares them). ``ckpt-inspect fake=false`` runs
the real steps instead (peaks from CUDA's allocator on a GPU), for comparison.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from lightning.fabric.utilities.apply_func import move_data_to_device
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.lightning.app import check_app_config, config_errors_exit, config_groups
from ckpt_plugin.engine.wrap import remove_checkpointing
from ckpt_plugin.measure.fake import NotFakeable
from ckpt_plugin.measure.floor import Floor, forward_floor
from ckpt_plugin.measure.memory import REST, SavedBytes, side_effect_free
from ckpt_plugin.measure.report import StepMeasure, measure_step, on_fake_model
from ckpt_plugin.measure.values import ValueRecord, recorded_values, values_line, with_values_replayed
from ckpt_plugin.units import format_bytes


@dataclass
class Inspection:
    """One step of a model measured without and with a ckpt config."""

    model: str
    names: list[str]
    without: SavedBytes
    with_ckpt: SavedBytes
    recompute_flops: dict[str, int]  # per selected module, and REST
    flops: tuple[int, int]  # whole step, without and with
    peaks: tuple[dict[str, int], dict[str, int]]  # by category, without and with
    floor: Floor | None = None  # the forward's own floor (ckpt_plugin/measure/floor.py): no config goes below it
    values: ValueRecord | None = None  # a step that reads values: what one forward without autograd recorded

    def __str__(self) -> str:
        rows = [*self.names, REST]
        w = max(len(r) for r in [*rows, "module"])
        lines = [
            f"{self.model}: one training step without and with the ckpt config",
            f"  {'module':<{w}}  {'kept without':>12}  {'kept with':>12}  {'recompute FLOPs':>16}",
        ]
        for r in rows:
            lines.append(
                f"  {r:<{w}}  {format_bytes(self.without.by_owner.get(r, 0)):>12}"
                f"  {format_bytes(self.with_ckpt.by_owner.get(r, 0)):>12}  {self.recompute_flops.get(r, 0):>16,}"
            )
        f0, f1 = self.flops
        lines.append(
            f"  {'total':<{w}}  {format_bytes(self.without.total):>12}  {format_bytes(self.with_ckpt.total):>12}"
            f"  {f1 - f0:>16,}"
        )
        (p0, p1) = self.peaks
        lines.append(f"  FLOPs of the step: {f0:,} without, {f1:,} with (ratio {f1 / f0:.3f})" if f0 else "")
        for key, label in (("act", "activation peak"), ("total", "total peak")):
            if key in p0:
                lines.append(
                    f"  {label}: {format_bytes(p0[key])} without, {format_bytes(p1[key])} with "
                    f"({p1[key] / p0[key]:.2f} of without)"
                )
        if self.floor is not None and "act" in p0:
            lines.append(f"  the forward's own floor: {self.floor.sentence(p0['act'])}")
        if self.values is not None:
            lines.append(f"  {values_line(self.values)}")
        return "\n".join(line for line in lines if line)


def _flops_by_module(step: Callable[[], Any], root: str, names: list[str]) -> tuple[int, dict[str, int]]:
    with FlopCounterMode(display=False) as counter:
        step()
    per = counter.get_flop_counts()
    by_name = {n: sum(per.get(f"{root}.{n}", {}).values()) for n in names}
    return counter.get_total_flops(), by_name


def inspect_step(
    model: nn.Module, step_loss: Callable[[], torch.Tensor], *, fake: bool = True, **ckpt_keys: Any
) -> Inspection:
    """Measure one step (``step_loss()`` returns the loss of one training step) without and with ``ckpt_keys``.

    ``fake=True``: every step runs on fake tensors (``_on_fake_model``),
    whatever the batch, for almost no memory; the bytes, FLOPs and peaks are
    those of real steps; a step that reads tensor values replays what one real forward without autograd
    read (``measure/values.py``). ``fake=False`` runs real steps.
    """
    config = make_config(**ckpt_keys)
    remove_checkpointing(model)

    def step() -> None:
        step_loss().backward()
        model.zero_grad(set_to_none=True)

    def measure(names: list[str]) -> tuple[StepMeasure, int, dict[str, int]]:
        measured = measure_step(model, step_loss, names, fake=fake, what="ckpt-inspect")  # what the fit-start report measures
        with on_fake_model(model, "ckpt-inspect") if fake else side_effect_free(model):
            total, by_name = _flops_by_module(step, type(model).__name__, names)
        return measured, total, by_name

    def inspected() -> Inspection:
        names = apply_config(model, config)  # checks the config against the model first
        remove_checkpointing(model)
        without, f0, by0 = measure(names)
        apply_config(model, config)
        try:
            with_ckpt, f1, by1 = measure(names)
        finally:
            remove_checkpointing(model)
        recompute = {n: by1[n] - by0[n] for n in names}
        recompute[REST] = (f1 - f0) - sum(recompute.values())
        floor = forward_floor(model, step_loss, fake=fake)
        return Inspection(type(model).__name__, names, without.kept, with_ckpt.kept, recompute, (f0, f1),
                          (without.peaks, with_ckpt.peaks), floor, recorded_values(model) if fake else None)

    # a step that reads values: its fake runs replay what one real step without autograd read
    return with_values_replayed(model, step_loss, inspected) if fake else inspected()


OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)  # --help: inspect.yaml's hydra.help


@hydra.main(version_base="1.3", config_path="pkg://ckpt_tools.configs", config_name="inspect")
def main(cfg: DictConfig) -> None:
    # Your app's modules (model._target_=train.YourModule) import from where you run it, as they do for
    # `python train.py` there; a console script's sys.path starts at its own bin directory instead.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    with config_errors_exit():  # a ckpt mistake: the message alone, exit code 2
        check_app_config(cfg)
        _inspect(cfg)


def _inspect(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    model.configure_model()
    device = torch.device(cfg.device)
    model.to(device).train()
    batch = move_data_to_device(next(iter(datamodule.train_dataloader())), device)
    keys = {k: v for k, v in cfg.ckpt.items() if k != "_target_"}
    try:
        with warnings.catch_warnings():
            # training_step's self.log() has no Trainer to log to here; that is expected.
            warnings.filterwarnings("ignore", message=".*self.log.*")
            result = inspect_step(model, lambda: model.training_step(batch, 0), fake=cfg.fake, **keys)
    except NotFakeable as err:
        hint = "ckpt-inspect fake=false measures real steps instead, in the memory they take."
        raise SystemExit(f"{err}\n{hint}") from err
    print(result)


if __name__ == "__main__":
    main()
