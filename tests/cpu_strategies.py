"""Test-only: Lightning's FSDP and DeepSpeed strategies on CPU (gloo), for 2-process tests here.

Lightning refuses both on CPU; the model code, our callback and the collective
algorithms are the same as on GPUs. Verified overrides: ../shared/notes/distributed-cpu.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch import nn


class CPUFSDPStrategy(FSDPStrategy):
    """FSDP (v1) on CPU: wrap with ``device_id=cpu`` first; Lightning then adds what it adds
    to an already-wrapped model (its activation_checkpointing_policy included)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(**kwargs)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            kwargs = {k: v for k, v in self.kwargs.items() if k != "auto_wrap_policy"}
            model = FullyShardedDataParallel(
                model, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                auto_wrap_policy=self.kwargs.get("auto_wrap_policy"), **kwargs,
            )
        return super()._setup_model(model)


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO on CPU: DeepSpeed's CPU accelerator, gloo, no shared-memory op build."""

    def __init__(self, **kwargs: Any) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.ops

        # Training does not need it; building it costs ~50 s per fresh machine.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skip the CUDA-only check

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None) -> Any:
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),  # CPU devices have no index
            config=self.config, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False,
        )
        return engine, ds_optimizer
