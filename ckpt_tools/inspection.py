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

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from lightning.fabric.utilities.apply_func import move_data_to_device
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin._compat import TorchDispatchMode, is_fake, tree_leaves
from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.lightning.app import check_app_config, config_errors_exit, config_groups
from ckpt_plugin.engine.wrap import remove_checkpointing
from ckpt_plugin.measure.fake import NotFakeable, fake_measurement
from ckpt_plugin.measure.floor import Floor, forward_floor
from ckpt_plugin.measure.memory import REST, SavedBytes, saved_bytes, side_effect_free, step_memory
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
        return "\n".join(line for line in lines if line)


def _flops_by_module(step: Callable[[], Any], root: str, names: list[str]) -> tuple[int, dict[str, int]]:
    with FlopCounterMode(display=False) as counter:
        step()
    per = counter.get_flop_counts()
    by_name = {n: sum(per.get(f"{root}.{n}", {}).values()) for n in names}
    return counter.get_total_flops(), by_name


def _peaks(step: Callable[[], Any], model: nn.Module, device: torch.device, fake: bool) -> dict[str, int]:
    if device.type == "cuda" and not fake:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return {"total": torch.cuda.max_memory_allocated(device), "act": torch.cuda.max_memory_allocated(device) - base}
    return step_memory(step, model)


@contextlib.contextmanager
def _on_fake_model(model: nn.Module, what: str) -> Iterator[None]:
    """``on_fake_tensors`` with the model's parameters and buffers swapped for their fake copies.

    ``on_fake_tensors`` converts parameters, buffers and the batch on use, and
    the mode memoises the copies weakly. Bytes saved and FLOPs come out exact
    that way, but not ``MemTracker``'s peaks: a view of a parameter
    (``weight.t()`` for a matmul) is a view of its copy, a storage MemTracker
    has never seen as a parameter, so it files it as an activation (the test
    GPT's activation peak came out 54 % high); and the copy of a batch tensor
    dies with the last op that reads it, where the real batch lives on (256 B
    low). So the module attributes hold the fake copies while the step runs
    (put back after), and the copy of every other real tensor an op reads is
    kept alive until the end, as the real tensor is.
    """
    slots = [(m, name, t) for m in model.modules()
             for name, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))]
    with fake_measurement(model, what) as mode, side_effect_free(model), mode, _KeepCopies(mode):
        copies = {id(t): mode.from_tensor(t) for _m, _name, t in slots}  # tied weights stay tied: one copy
        try:
            for m, name, t in slots:
                setattr(m, name, copies[id(t)])
            yield
        finally:
            for m, name, t in slots:
                setattr(m, name, t)


class _KeepCopies(TorchDispatchMode):
    """Keeps the fake copy of every real tensor an op reads (the batch) alive while it is in force."""

    def __init__(self, mode: Any) -> None:
        super().__init__()
        self.mode = mode
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (real, its copy): both held

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not is_fake(t) and id(t) not in self.copies:
                self.copies[id(t)] = (t, self.mode.from_tensor(t))  # the copy the op will get: memoised
        return func(*args, **(kwargs or {}))


def inspect_step(
    model: nn.Module, step_loss: Callable[[], torch.Tensor], *, fake: bool = True, **ckpt_keys: Any
) -> Inspection:
    """Measure one step (``step_loss()`` returns the loss of one training step) without and with ``ckpt_keys``.

    ``fake=True``: every step runs on fake tensors (``_on_fake_model``),
    whatever the batch, for almost no memory; the bytes, FLOPs and peaks are
    those of real steps. A step that reads tensor values raises
    :class:`~ckpt_plugin.measure.fake.NotFakeable`. ``fake=False`` runs real steps.
    """
    config = make_config(**ckpt_keys)
    remove_checkpointing(model)
    device = next(model.parameters()).device

    def step() -> None:
        step_loss().backward()
        model.zero_grad(set_to_none=True)

    def measuring() -> contextlib.AbstractContextManager:
        return _on_fake_model(model, "ckpt-inspect") if fake else side_effect_free(model)

    def measure(names: list[str]) -> tuple[SavedBytes, int, dict[str, int], dict[str, int]]:
        with measuring():
            kept = saved_bytes(model, step_loss, names)
        with measuring():
            total, by_name = _flops_by_module(step, type(model).__name__, names)
        with measuring():
            peaks = _peaks(step, model, device, fake)
        return kept, total, by_name, peaks

    names = apply_config(model, config)  # checks the config against the model first
    remove_checkpointing(model)
    without, f0, by0, p0 = measure(names)
    apply_config(model, config)
    try:
        with_ckpt, f1, by1, p1 = measure(names)
    finally:
        remove_checkpointing(model)
    recompute = {n: by1[n] - by0[n] for n in names}
    recompute[REST] = (f1 - f0) - sum(recompute.values())
    floor = forward_floor(model, step_loss, fake=fake)
    return Inspection(type(model).__name__, names, without, with_ckpt, recompute, (f0, f1), (p0, p1), floor)


OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)  # --help: inspect.yaml's hydra.help


@hydra.main(version_base="1.3", config_path="pkg://ckpt_tools.configs", config_name="inspect")
def main(cfg: DictConfig) -> None:
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
