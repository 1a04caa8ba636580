"""OmegaConf resolvers the shipped configs use (registered when Hydra starts, by our search-path plugin)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def processes(devices: Any, num_nodes: Any = 1) -> int:
    """How many processes a Trainer with ``devices`` on ``num_nodes`` starts, as Lightning counts them.

    ``trainer=model_parallel`` needs it: ModelParallelStrategy's "auto" data-parallel
    size is the number of nodes (the rest goes to tensor parallelism), but a model
    without tensor parallelism (FSDP2 alone) wants every process data-parallel.
    """
    if isinstance(devices, list | tuple) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        per_node = len(devices)
    elif str(devices) in ("auto", "-1"):
        import torch

        per_node = torch.cuda.device_count() or 1  # Lightning's auto: every GPU, else one CPU process
    elif isinstance(devices, str) and "," in devices:
        per_node = len([d for d in devices.split(",") if d.strip()])
    else:
        per_node = int(devices)
    return per_node * int(num_nodes)


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("ckpt_plugin.processes", processes, replace=True)
