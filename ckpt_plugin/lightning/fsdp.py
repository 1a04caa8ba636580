"""``ckpt.memory`` under Lightning's ``FSDPStrategy`` (FSDP v1): one rank's sharded step, measured on a fake twin.

Under FSDP a rank holds its shards of the parameters, gradients and optimizer
state, and, for a moment, each unit's gathered parameters and gradients
(reduce-scattered in backward); how many units are gathered at once depends on
the wrap policy, the sharding strategy and the prefetching. None of that is
modelled here: the strategy itself shards a twin of the module, and the twin's
step is measured as any step is.

The twin (:func:`twin_of`) is a copy of the LightningModule whose parameters and
buffers are fake tensors (nothing allocated) and whose other attributes are the
module's own (the trainer, the data). The strategy wraps it as it will wrap the
module (``FSDPStrategy._setup_model``: its wrap policy, sharding strategy, mixed
precision, prefetching, its device), given a fake process group of the run's
size and this rank (``_compat/fsdp.py``); its optimizers are the module's
``configure_optimizers`` on the twin's sharded parameters, as Lightning builds
them after wrapping; its ``training_step`` runs through the FSDP root, as
``FSDPStrategy.training_step`` runs it. Measured with 2 gloo processes, the
twin's second step equals the real rank's in every MemTracker category.

When: Lightning's FSDP moves the module to the device and shards it in
``strategy.setup``, after the callback's ``setup`` hook and before
``on_fit_start``. The plan is made in ``setup`` (``callback.py``), where the
module is whole: the planner's profile runs on it as under DDP (activations on
fake tensors, step time one layer at a time, where the module is then: on the
CPU unless it was built on the device), and every whole step on the twin. The
plan names the module's layers as they are named before wrapping; at
``on_fit_start`` it is renamed to the wrapped module's names (the same modules:
FSDP puts each unit's module inside it, as ``blocks.0._fsdp_wrapped_module``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from ckpt_plugin._compat import (
    fake_copy,
    fake_process_group,
    fake_tensor_mode,
    fsdp_on_fake_tensors,
    tree_map,
    user_module,
)
from ckpt_plugin.apply.batch import Sample
from ckpt_plugin.apply.memory import whole_of
from ckpt_plugin.engine.plan import EachLayer, Segments, WrapPlan
from ckpt_plugin.measure.whole_step import Held, StepSplit

_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32,
                "64-true": torch.float64}


def is_fsdp(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``FSDPStrategy`` (FSDP v1), whose whole step the twin measures."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


@dataclass
class Twin:
    """A fake twin of the LightningModule, sharded by the strategy as the module will be (module docstring)."""

    module: pl.LightningModule  # the twin LightningModule, inside ``wrapped``
    wrapped: nn.Module  # the FSDP root around it
    optimizers: list[torch.optim.Optimizer]
    mode: Any  # the fake-tensor mode its tensors belong to
    names: dict[str, str]  # a module's name in the LightningModule (before wrapping) -> in the twin (after)
    rank: int
    world_size: int

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self.mode, fsdp_on_fake_tensors():
            yield


def twin_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Twin:
    """The fake twin of ``pl_module`` (whole: before the strategy's setup), as ``trainer.strategy`` will shard it."""
    from lightning.pytorch.core.optimizer import (
        _init_optimizers_and_lr_schedulers,  # private to Lightning
    )

    strategy = trainer.strategy
    mode = fake_tensor_mode()
    # FSDPStrategy.setup converts the module to a "true" precision's dtype before wrapping it (FSDPPrecision.
    # convert_module: module.to(dtype)), and FSDP moves it to its device; Module.to cannot swap a fake parameter
    # in place ("Couldn't swap"), so the copy is made in that dtype, on that device.
    twin, copies = fake_copy(pl_module, mode, _TRUE_DTYPES.get(str(trainer.precision)), strategy.root_device)
    before = {id(m): n for n, m in user_module(pl_module).named_modules()}
    kwargs = strategy.kwargs
    with mode, fsdp_on_fake_tensors():
        strategy.kwargs = {**kwargs, "process_group": fake_process_group(trainer.global_rank, trainer.world_size)}
        try:
            wrapped = strategy._setup_model(twin)  # private: the strategy's own wrapping
        finally:
            strategy.kwargs = kwargs
        optimizers, _schedulers = _init_optimizers_and_lr_schedulers(twin)
    after = {id(m): n for n, m in user_module(twin).named_modules()}
    names = {before[i]: after[id(copy)] for i, copy in copies.items() if i in before and id(copy) in after}
    return Twin(twin, wrapped, list(optimizers), mode, names, trainer.global_rank, trainer.world_size)


@dataclass(frozen=True)
class TwinSteps:
    """``ckpt.memory``'s whole step on the twin (``apply/memory.WholeSteps``): ``sample`` is the twin's (its batch
    fake, its step the module's ``training_step`` through the FSDP root: :func:`twin_sample`), the twin's
    optimizers stepping; ``held``: what the device holds beside it, the batch added."""

    twin: Twin
    sample: Sample
    held: tuple[Held, ...] = ()

    def of(self, plan: WrapPlan, rows: int | None = None) -> StepSplit:
        with self.twin.active():
            return whole_of(self.twin.module, renamed(plan, self.twin.names), self.sample.loss(rows),
                            self.twin.optimizers, (*self.held, self.sample.held(rows)), fake=False)


def twin_sample(twin: Twin, sample: Sample, run: Callable[..., Any], step: Callable[[Any], Any] | None) -> Sample:
    """``sample`` for the twin: its call and batch as fake tensors of the twin's mode, ``run`` and ``step`` the
    twin's (``step`` None where the module's step is not measured: the call, summed)."""
    def fake(value: Any) -> Any:
        return tree_map(lambda t: twin.mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, value)

    return Sample(fake(sample.call), run, fake(sample.batch), step if sample.step is not None else None)


def renamed(plan: WrapPlan, names: Mapping[str, str]) -> WrapPlan:
    """``plan`` with each module name (or op group under it) taken to ``names[name]``: the same modules, named
    after the strategy wrapped them; a name ``names`` lacks is kept."""

    def one(name: str) -> str:
        head, _, tail = name, "", ""
        while head and head not in names and "." in head:  # an op group's part: blocks.0.<group> under blocks.0
            head, _, last = head.rpartition(".")
            tail = f"{last}.{tail}" if tail else last
        if head in names:
            return ".".join(filter(None, [names[head], tail]))
        return name

    groups = tuple(replace(g, names=tuple(one(n) for n in g.names)) if isinstance(g, EachLayer | Segments) else g
                   for g in plan.groups)
    return replace(plan, groups=groups, regroup=tuple(one(n) for n in plan.regroup))


def names_after_wrapping(before: Mapping[str, nn.Module], pl_module: pl.LightningModule) -> dict[str, str]:
    """Each name of ``before`` (the modules by name before the strategy wrapped them) -> the name the same module
    has in ``pl_module`` now."""
    now = {id(m): n for n, m in user_module(pl_module).named_modules()}
    return {name: now[id(m)] for name, m in before.items() if id(m) in now}


__all__ = ["Twin", "TwinSteps", "is_fsdp", "names_after_wrapping", "renamed", "twin_of", "twin_sample"]
