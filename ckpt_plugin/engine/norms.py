"""Running statistics that a recomputation must not update twice (pytorch#96136).

A BatchNorm in training mode updates ``running_mean``, ``running_var`` and
``num_batches_tracked`` on every forward, so recomputing it for backward
counts each batch twice. Upstream torch leaves this open; we snapshot the
buffers when a recomputation starts and write them back when it ends, so they
match a run without checkpointing bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ckpt_plugin.engine.op_groups import OpGroup

# Buffers that a forward in training mode updates in place (BatchNorm,
# InstanceNorm with track_running_stats, SyncBatchNorm, and look-alikes).
_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def running_stats(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """The running-statistics buffers a call of ``module`` may update: in its subtree, and in the modules
    an op group (``op_groups.py``) calls without owning them."""
    reached = dict.fromkeys(module.modules())
    for m in list(reached):
        for called in m.calls() if isinstance(m, OpGroup) else ():
            reached.update(dict.fromkeys(called.modules()))
    return [
        (m, name)
        for m in reached
        for name in _RUNNING_STATS
        if isinstance(getattr(m, name, None), torch.Tensor)
    ]


@contextlib.contextmanager
def keep_running_stats(stats: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """Undo whatever the recomputation writes into running-statistics buffers."""
    with torch.no_grad():  # a snapshot, not an activation: no graph, and MemTracker files it as temporary
        saved = [(m, name, getattr(m, name).clone()) for m, name in stats if m.training]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, value in saved:
                getattr(m, name).copy_(value)
