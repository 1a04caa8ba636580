"""``ckpt.memory`` under Lightning's ``FSDPStrategy`` (FSDP v1) and ``ModelParallelStrategy`` (FSDP2): one rank's
sharded step, measured on a fake twin (``apply/twin.py``) sharded as the module will be.

The strategy wraps the twin as it will wrap the module (``FSDPStrategy._setup_model``,
private to Lightning: its wrap policy, sharding strategy, mixed precision,
prefetching, its device), given a fake process group of the run's size and this
rank; the twin's optimizers are the module's ``configure_optimizers`` on its
sharded parameters, as Lightning builds them after wrapping; its
``training_step`` runs through the FSDP root, as ``FSDPStrategy.training_step``
runs it (``memory.py``). Measured with 2 gloo processes, every rank's real step
was within 68 B of the twin's (``tests/test_fit_fsdp.py``).

FSDP2: the module shards itself, in its own ``configure_model``, with the strategy's
``DeviceMesh`` (``self.device_mesh``). The twin's ``configure_model`` runs on a mesh of the
same layout whose groups are fake (``_compat.fake_device_mesh``): its ``fully_shard`` calls
shard the fake parameters as the real ones will be, and its step is the module's own
``training_step`` (``ModelParallelStrategy`` calls it directly). What a ``configure_model``
does that cannot run there (a collective on a group it makes itself) is a ``ConfigError``
naming it; tensor parallel on the same mesh does not run there (:func:`tensor_parallel_refused`).

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

from ckpt_plugin._compat import fake_device_mesh
from ckpt_plugin.apply.twin import Twin, make_twin
from ckpt_plugin.errors import ConfigError, Problem

_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32,
                "64-true": torch.float64}


def is_fsdp(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``FSDPStrategy`` (FSDP v1), whose whole step the twin measures."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def is_fsdp2(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``ModelParallelStrategy``, under which the module shards itself with
    FSDP2 in ``configure_model``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def tensor_parallel_refused(strategy: Any) -> ConfigError | None:
    """The error for ``ckpt=auto`` under ``ModelParallelStrategy`` with a dimension of its mesh besides data
    parallel (tensor parallel) larger than one, else None. ``parallelize_module`` distributes each parameter with
    collectives on the mesh's groups, which the twin's fake groups do not carry (torch 2.13: "Group ... is not
    registered"), so its layout cannot be measured; and a plan made on the whole module would price activations
    that tensor parallel splits. A plan made without it names the same layers (``parallelize_module`` renames
    none)."""
    mesh = getattr(strategy, "device_mesh", None) if is_fsdp2(strategy) else None
    names, shape = tuple(getattr(mesh, "mesh_dim_names", None) or ()), tuple(getattr(mesh, "shape", ()) or ())
    split = {name: size for name, size in zip(names, shape, strict=False) if name != "data_parallel" and size > 1}
    if not split:
        return None
    layout = ", ".join(f"{name}_size={size}" for name, size in split.items())
    return ConfigError([Problem(
        "ckpt.mode",
        f"ckpt=auto cannot plan under trainer.strategy {type(strategy).__name__} with {layout}: the module's "
        "configure_model lays out tensor parallelism with collectives the fake process groups that ckpt=auto "
        "measures the sharded step on do not carry (data parallel alone, FSDP2's fully_shard, is planned)",
        "plan the same module with tensor_parallel_size=1 (a ckpt=auto run writes ckpt_plan.json) and give the "
        "file with ckpt.plan=<file>, or choose a fixed mode (ckpt=full, ckpt=selective, ckpt=offload)",
    )])


def plans_on_a_twin(strategy: Any) -> bool:
    """Whether ``ckpt=auto`` plans in ``setup``, each whole step on a fake twin (FSDP v1 or FSDP2)."""
    return is_fsdp(strategy) or is_fsdp2(strategy)


def twin_of(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Twin:
    """The fake twin of ``pl_module`` (whole: before the strategy's setup), as ``trainer.strategy`` will shard it."""
    from lightning.pytorch.core.optimizer import (
        _init_optimizers_and_lr_schedulers,  # private to Lightning: configure_optimizers, as the Trainer reads it
    )

    strategy = trainer.strategy

    def wrap(twin: torch.nn.Module, group: Any) -> torch.nn.Module:
        if is_fsdp2(strategy):
            return _configured(twin, pl_module, strategy)
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


def _configured(twin: torch.nn.Module, pl_module: pl.LightningModule, strategy: Any) -> torch.nn.Module:
    """``twin`` after the module's own ``configure_model`` ran on it with a fake mesh of the strategy's layout."""
    twin._device_mesh = fake_device_mesh(strategy.device_mesh)  # LightningModule.device_mesh reads it
    try:
        twin.configure_model()
    except Exception as err:  # a collective on a group it made itself, a tensor-parallel plan the fake group lacks
        raise ConfigError([Problem(
            "ckpt.mode",
            f"ckpt=auto: {type(pl_module).__name__}.configure_model did not run on the fake twin ckpt=auto measures the sharded "
            f"step on under {type(strategy).__name__} (a mesh of fake process groups, fake tensors): "
            f"{type(err).__name__}: {err}",
            "plan on one process or under DDP (a ckpt=auto run writes ckpt_plan.json) and give the file with "
            "ckpt.plan=<file>, or choose a fixed mode (ckpt=full, ckpt=selective, ckpt=offload)",
        )]) from err
    return twin


__all__ = ["is_fsdp", "is_fsdp2", "plans_on_a_twin", "tensor_parallel_refused", "twin_of"]
