"""Exact resume from a mid-epoch checkpoint: the random streams, which Lightning's checkpoint leaves out.

    python recipes/train.py 'callbacks=[activation_checkpointing,model_checkpoint]' ckpt_path=last

A Lightning (2.6) checkpoint holds the weights, the optimizer, the loop counters,
each callback's ``state_dict`` and, under ``loops``, the ``state_dict`` of every
train loader that has one (``CombinedLoader._state_dicts``). A run killed
mid-epoch and resumed from it still drifts from one never interrupted unless two
more things come back:

- **The dataloader's position.** A plain ``DataLoader`` replays the epoch from
  its first batch, and Lightning warns "your dataloader is not resumable".
  torchdata's ``StatefulDataLoader`` saves where it stood, with its workers' base
  seed; the example ``TextData`` and ``ImageData`` hand out one
  (``ckpt_examples.data.EpochAwareDataLoader``, which adds the sampler's epoch
  and its generator: Lightning#21938, torchdata#1513).
- **The random streams.** Lightning saves no RNG state, so dropout masks after
  the resume are those of the run's first steps. ``ResumableRNG`` saves the
  torch (CPU and the rank's GPU), numpy and Python generators of every rank and
  gives each rank its own back.

With both (``callbacks=model_checkpoint`` brings the callback) the resumed losses
equal the uninterrupted run's bit for bit, with ``data.num_workers`` 0 or 2
(``tests/test_resume.py``: 2 processes, SIGKILL, resume).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from ckpt_plugin.runs.preemption import Preemption, hpc_checkpoints

__all__ = ["ResumableRNG", "latest_checkpoint"]


class ResumableRNG(pl.Callback):
    """Save every rank's random generators in the checkpoint; give each its own back on resume.

    >>> trainer = Trainer(callbacks=[ModelCheckpoint(save_last=True), ResumableRNG()])

    Lightning 2.6 still needs it: ``CheckpointConnector.dump_checkpoint`` writes no RNG state (only the spawn
    launcher carries generator states, into the processes it starts).

    Rank 0 writes the checkpoint, but each rank draws its own dropout masks, so
    ``state_dict`` gathers the states of all ranks (a collective: every rank
    saves, as Lightning's ``trainer.save_checkpoint`` requires anyway).
    They are set back in ``on_train_start``: after everything that draws at the
    start of a run (model init, ``on_fit_start`` forwards, a plain
    ``DataLoader``'s ``iter()``) and before the first batch is fetched, which
    is where the saving run's generators stood after its last saved step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._device: torch.device | None = None  # this rank's device, for its CUDA generator
        self._to_restore: list[dict[str, Any]] | None = None  # per rank, from load_state_dict until on_train_start

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._device = trainer.strategy.root_device

    def state_dict(self) -> dict[str, Any]:
        mine = self._collect()
        if dist.is_available() and dist.is_initialized():
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        return {"ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict["ranks"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ranks, self._to_restore = self._to_restore, None
        if ranks is None:
            return
        if len(ranks) != trainer.world_size:
            rank_zero_warn(
                f"ResumableRNG: the checkpoint holds the random states of {len(ranks)} process(es), this run has "
                f"{trainer.world_size}; the random streams start from the seed, so the run will not continue exactly"
            )
            return
        self._restore(ranks[trainer.global_rank])

    def _collect(self) -> dict[str, Any]:
        # Plain tensors, ints and tuples: torch.load(weights_only=True), Lightning's default, reads them.
        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        states: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "python": random.getstate(),
        }
        if self._device is not None and self._device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self._device)
        return states

    def _restore(self, states: dict[str, Any]) -> None:
        torch.set_rng_state(states["torch"])
        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        random.setstate(states["python"])
        if "cuda" in states and self._device is not None and self._device.type == "cuda":
            torch.cuda.set_rng_state(states["cuda"], self._device)


def latest_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest complete resume point, or None if there is none.

    The candidates: ``ModelCheckpoint``'s ``last.ckpt`` (every few steps) and the
    highest ``hpc_ckpt_<n>.ckpt`` that ``Preemption`` saved on a signal, in
    ``trainer.default_root_dir`` or its ``dirpath``. Lightning 2.6 loads an hpc
    checkpoint only when ``ckpt_path`` is None, and ``ckpt_path="last"`` looks at
    ``last.ckpt`` only, so a requeued job would redo the steps since the last
    ``last.ckpt``; ``recipes/train.py`` resolves ``ckpt_path=last`` with this instead.
    A write that was killed left only a hidden ``.<name>.partial`` (``atomic.py``),
    which is never a candidate. Files and sharded directories alike.
    """
    candidates = [
        Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb.dirpath
    ]
    hpc_dirs = {str(trainer.default_root_dir)} | {
        str(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, Preemption) and cb.dirpath
    }
    for directory in sorted(hpc_dirs):
        if saved := hpc_checkpoints(directory):
            candidates.append(saved[max(saved)])  # Lightning's own choice: the highest n
    found = [p for p in candidates if p.exists()]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None
