"""``ckpt.memory`` under Lightning's ``FSDPStrategy`` (FSDP v1): one rank's sharded step, measured on a fake twin
(``apply/twin.py``) that the strategy shards as it will shard the module.

The strategy wraps the twin as it will wrap the module (``FSDPStrategy._setup_model``,
private to Lightning: its wrap policy, sharding strategy, mixed precision,
prefetching, its device), given a fake process group of the run's size and this
rank; the twin's optimizers are the module's ``configure_optimizers`` on its
sharded parameters, as Lightning builds them after wrapping; its
``training_step`` runs through the FSDP root, as ``FSDPStrategy.training_step``
runs it (``memory.py``). Measured with 2 gloo processes, every rank's real step
was within 68 B of the twin's (``tests/test_fit_fsdp.py``).

When: Lightning's FSDP moves the module to the device and shards it in
``strategy.setup``, after the callback's ``setup`` hook and before
``on_fit_start``. The plan is made in ``setup`` (``callback.py``), where the
module is whole: the planner's profile runs on it as under DDP (activations on
fake tensors, step time one layer at a time, where the module is then: on the
CPU unless it was built on the device), and every whole step on the twin. At
``on_fit_start`` the plan is renamed to the wrapped module's names.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from ckpt_plugin.apply.twin import Twin, make_twin

_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32,
                "64-true": torch.float64}


def is_fsdp(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``FSDPStrategy`` (FSDP v1), whose whole step the twin measures."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def twin_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Twin:
    """The fake twin of ``pl_module`` (whole: before the strategy's setup), as ``trainer.strategy`` will shard it."""
    from lightning.pytorch.core.optimizer import (
        _init_optimizers_and_lr_schedulers,  # private to Lightning: configure_optimizers, as the Trainer reads it
    )

    strategy = trainer.strategy

    def wrap(twin: torch.nn.Module, group: Any) -> torch.nn.Module:
        kwargs = strategy.kwargs
        strategy.kwargs = {**kwargs, "process_group": group}
        try:
            return strategy._setup_model(twin)  # private: the strategy's own wrapping
        finally:
            strategy.kwargs = kwargs  # _setup_model may drop a key of its own

    def optimizers_of(twin: torch.nn.Module) -> list[torch.optim.Optimizer]:
        return list(_init_optimizers_and_lr_schedulers(twin)[0])

    # FSDPStrategy.setup converts the module to a "true" precision's dtype (FSDPPrecision.convert_module) before
    # wrapping it, and FSDP moves it to its device: the twin is made so.
    return make_twin(pl_module, wrap, optimizers_of, rank=trainer.global_rank, world_size=trainer.world_size,
                     dtype=_TRUE_DTYPES.get(str(trainer.precision)), device=strategy.root_device)


__all__ = ["is_fsdp", "twin_of"]
