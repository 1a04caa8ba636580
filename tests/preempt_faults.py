"""Test-only faults for the preemption tests: real signals at chosen points of a step, a save that stalls.

Loaded in-process by tests/test_preemption.py and inside SLURM jobs by tests/test_slurm.py
(``+callbacks.fault._target_=preempt_faults.SendSignal``, with ``tests/`` on PYTHONPATH).
Nothing is mocked: the process sends itself the signal with ``os.kill``, and Python runs the
handler at the next bytecode of the main thread, wherever that is.
"""

from __future__ import annotations

import os
import signal as signals
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ckpt_plugin.runs.atomic import AtomicCheckpointIO

AT = ("backward", "optimizer_step", "save")


def restart_count() -> int:
    """Which start of a SLURM job this is: 0, then 1 after the first requeue (0 outside SLURM)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


class SendSignal(pl.Callback):
    """Send ``signal`` to this process while step ``step`` (global_step when it begins) is at ``at``.

    ``at``: ``backward`` (from a gradient hook on the output of a layer in the middle of the model:
    the autograd engine is mid-graph and, under DDP, buckets are being all-reduced), ``optimizer_step``
    (from a pre-hook inside ``optimizer.step()``), ``save`` (from ``on_save_checkpoint``, inside
    ``trainer.save_checkpoint``). ``ranks``: which ranks send (None: all). ``start``: in which start
    of a SLURM job (``SLURM_RESTART_COUNT``).
    """

    def __init__(self, at: str, step: int, signal: str = "SIGUSR1", ranks: list[int] | None = None, start: int = 0):
        if at not in AT:
            raise ValueError(f"SendSignal(at={at!r}): choose one of {AT}")
        self.at, self.step, self.signum = at, step, signals.Signals[signal]
        self.ranks, self.start = None if ranks is None else list(ranks), start
        self.sent: list[int] = []  # global steps at which it fired, for in-process tests

    def _armed(self, trainer: pl.Trainer) -> bool:
        return (
            trainer.global_step == self.step
            and restart_count() == self.start
            and (self.ranks is None or trainer.global_rank in self.ranks)
            and not self.sent
        )

    def _send(self, trainer: pl.Trainer) -> None:
        self.sent.append(trainer.global_step)
        print(f"[fault] rank {trainer.global_rank} sends {self.signum.name} during {self.at} of step {self.step}",
              flush=True)  # fmt: skip
        os.kill(os.getpid(), self.signum)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at == "optimizer_step":
            for optimizer in trainer.optimizers:
                optimizer.register_step_pre_hook(lambda *_: self._send(trainer) if self._armed(trainer) else None)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self.at == "backward" and self._armed(trainer):
            # The gradient of the output of a module half-way through the model: a hook on the activation, not
            # on a parameter (FSDP2 computes with unsharded copies; the sharded parameter sees no autograd hook).
            layers = [m for m in pl_module.modules() if next(m.parameters(recurse=False), None) is not None]
            handle = layers[len(layers) // 2].register_forward_hook(self._hook_output)
            self._forward_hook = handle

    def _hook_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._forward_hook.remove()  # the first forward only, not the recomputation
        trainer = self._trainer
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: None if self.sent else self._send(trainer))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.at == "save" and self._armed(trainer):
            self._send(trainer)


class StallingCheckpointIO(AtomicCheckpointIO):
    """Writes half of a preemption checkpoint (``.hpc_ckpt_*`` partial) to disk, flushed, then hangs.

    Only in start ``start`` of a SLURM job; every other save is :class:`AtomicCheckpointIO`'s. The
    test then kills the job mid-save, as SIGKILL at the end of a grace time does.
    """

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.start = start

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = Path(path)
        if not (target.name.startswith(".hpc_ckpt_") and restart_count() == self.start):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        import io

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        with open(target, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        print(f"[fault] wrote {len(data) // 2} of {len(data)} bytes of {target}; stalling", flush=True)
        time.sleep(600)


class Throttle(pl.Callback):
    """Sleep at the end of every step of start ``start`` from global step ``after`` on: time for a signal sent
    from outside once a checkpoint exists (the steps before it need none); changes no number."""

    def __init__(self, seconds: float, start: int = 0, after: int = 0) -> None:
        self.seconds, self.start, self.after = seconds, start, after

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if restart_count() == self.start and trainer.global_step >= self.after:
            time.sleep(self.seconds)
