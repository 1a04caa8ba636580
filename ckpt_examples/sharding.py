"""FSDP2 for the examples: what their ``configure_model`` does under ``trainer=model_parallel``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def shard_blocks(model: nn.Module, blocks: Iterable[nn.Module], mesh: Any) -> None:
    """FSDP2 ``fully_shard`` on each block, then on the whole model, over the data-parallel mesh.

    The blocks keep their class name for ``ckpt.layers`` (fully_shard makes
    them ``FSDPTransformerBlock``, a subclass, which the selection matches).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):  # configure_model may run more than once
        return
    dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    for block in blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)


__all__ = ["shard_blocks"]
