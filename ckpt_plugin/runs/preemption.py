"""``Preemption``: a signal only sets a flag; all ranks save together at the next step boundary, then requeue.

    trainer = Trainer(callbacks=[Preemption(), ModelCheckpoint(save_last=True)], plugins=[AtomicCheckpointIO()])

Why not Lightning's own SLURM handler: ``SLURMEnvironment(auto_requeue=True)``
saves the checkpoint *inside* the signal handler (Lightning-AI/pytorch-lightning#21406,
open; the flag-based fix of PR #21407 is not merged). A handler runs between any
two bytecodes of the main thread: in the middle of backward, of the optimizer
step, of another save, or while the other ranks wait in DDP's all-reduce. Its
save enters collectives (the save barrier, ``ResumableRNG``'s gather) that the
other ranks are not at, and the job intermittently never finishes. Lightning's
SIGTERM handler likewise broadcasts from inside the handler.

What this callback does instead:

1. ``setup`` switches Lightning's in-handler save off (``SLURMEnvironment.auto_requeue = False``)
   and installs a handler for the requeue signal and for SIGTERM that records the
   signal and returns. ``on_train_start`` installs it again, over the SIGTERM
   handler Lightning registers after ``setup``.
2. At every optimizer-step boundary (``on_train_batch_end`` after
   ``global_step`` moved), one ``all_gather`` of one small integer per rank
   tells every rank what any rank received, so all stop at the same step even
   if the signal reached only one.
3. All ranks save through ``trainer.save_checkpoint`` (the strategy's own path:
   one file under DDP, a sharded directory under FSDP or DeepSpeed) into
   ``.hpc_ckpt_<n>.ckpt.partial``; rank 0 flushes it and renames it to
   ``hpc_ckpt_<n>.ckpt`` (:mod:`ckpt_plugin.runs.atomic`). A kill before
   the rename leaves the previous checkpoint as the newest complete one.
4. On the requeue signal rank 0 requeues the job (``scontrol requeue``, or
   submitit's own handler when submitit launched the job). On SIGTERM alone it
   requeues only a job that SLURM is preempting (``JobState=RUNNING`` with a
   ``PreemptTime``): SLURM requeues a preempted job itself only if it is still
   running when the grace time ends, and ours has already exited. After
   ``scancel`` or at the time limit nothing is requeued.
5. Rank 0, if it requeued, waits (at most a minute) for the SIGTERM with which
   SLURM ends the requeued start, so that the batch script cannot end first.
   Every rank raises :class:`Preempted` (a ``SystemExit`` with code 128 + the
   signal, as a shell reports a death by signal), which ends ``fit`` through
   Lightning's own exception path: nothing after ``fit`` runs on a half-trained model.

The name ``hpc_ckpt_<n>.ckpt`` in ``trainer.default_root_dir`` is Lightning's own:
``fit(ckpt_path=None)`` under SLURM resumes from the highest ``n``, and
``ckpt_plugin.runs.resume.latest_checkpoint`` weighs it against ``last.ckpt``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ckpt_plugin.runs import slurm
from ckpt_plugin.runs.atomic import partial_path, publish, remove_path

__all__ = ["HPC_PREFIX", "Preempted", "Preemption", "hpc_checkpoints"]

HPC_PREFIX = "hpc_ckpt_"  # Lightning's name for the checkpoint a requeue resumes from
_REQUEUE, _TERM = 1, 2  # bits of what a rank received
_UNHANDLED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM}  # SIGTERM is always handled; the others cannot be


class Preempted(SystemExit):
    """Raised on every rank once the preemption checkpoint is complete; its code is 128 + the signal's number."""

    def __init__(self, signum: int, path: Path) -> None:
        super().__init__(128 + signum)
        self.signum, self.path = signum, path


def hpc_checkpoints(dirpath: str | os.PathLike) -> dict[int, Path]:
    """The complete ``hpc_ckpt_<n>.ckpt`` files or directories in ``dirpath``, by ``n``."""
    found = {}
    directory = Path(dirpath)
    if directory.is_dir():
        for path in directory.iterdir():
            match = re.fullmatch(rf"{HPC_PREFIX}(\d+)\.ckpt", path.name)
            if match:
                found[int(match[1])] = path
    return found


def _signal_named(value: str | int) -> signal.Signals:
    """``"SIGUSR2"``, ``"USR2"`` or 12 as a signal, or an error naming the key, the value and the choices."""
    names = sorted(s.name for s in signal.Signals if s not in _UNHANDLED)
    try:
        if isinstance(value, int):
            sig = signal.Signals(value)
        else:
            text = str(value).strip().upper()
            sig = signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ValueError(
            f"Preemption(requeue_signal={value!r}): not a signal; choose one of {', '.join(names)} "
            "(SLURM's --signal=SIGUSR1@90 sends SIGUSR1; submitit uses SIGUSR2)"
        ) from None
    if sig in _UNHANDLED:
        reason = "is always handled (it means: save and stop)" if sig == signal.SIGTERM else "cannot be caught"
        raise ValueError(
            f"Preemption(requeue_signal={value!r}): {sig.name} {reason}; choose one of {', '.join(names)}"
        )
    return sig


class Preemption(pl.Callback):
    """On the requeue signal or SIGTERM: at the next step boundary, all ranks save atomically, rank 0 requeues, all exit.

    Args:
        requeue_signal: the signal that means "save, then requeue", by name (``"SIGUSR1"``,
            ``"USR2"``). ``None``: submitit's own signal when submitit launched the job
            (``SUBMITIT_PREEMPT_SIGNAL``, else SIGUSR2), otherwise the ``requeue_signal`` of
            the trainer's ``SLURMEnvironment``, otherwise SIGUSR1 (what ``#SBATCH --signal=SIGUSR1@90`` sends).
        dirpath: where ``hpc_ckpt_<n>.ckpt`` goes; ``None``: ``trainer.default_root_dir``,
            where Lightning itself looks for it.
        requeue: whether rank 0 requeues the job after the save on the requeue signal.
            ``None``: when running in a SLURM job (``SLURM_JOB_ID`` is set).
    """

    def __init__(self, requeue_signal: str | int | None = None, dirpath: str | None = None, requeue: bool | None = None):
        super().__init__()
        self.requeue_signal = None if requeue_signal is None else _signal_named(requeue_signal)
        self.dirpath = dirpath
        self.requeue = requeue
        self._signal: signal.Signals | None = None  # resolved in setup
        self._received: dict[int, float] = {}  # signal -> time.monotonic() of its latest arrival; the handler's only write
        self._previous: dict[int, Any] = {}  # the handlers we replaced, to restore or to pass signals on to
        self._armed = False
        self._checked_step = -1

    # -- the handler: records, returns ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._armed:
            self._received[signum] = time.monotonic()  # no I/O here: a print can raise "reentrant call" mid-write
            return
        # Outside training (after fit ended with an error): behave as if we were never installed.
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("Preemption: fit runs outside the main thread, where Python cannot set signal handlers")
            return
        for signum in (self._signal, signal.SIGTERM):
            current = signal.getsignal(signum)
            if current != self._on_signal:
                self._previous.setdefault(signum, current)  # the first: what was there before us
                signal.signal(signum, self._on_signal)
        self._armed = True

    def _restore(self) -> None:
        self._armed = False
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        # _previous stays: Lightning's teardown may put our handler back (it was there when Lightning registered),
        # and a disarmed handler passes each signal on to what it replaced.

    # -- Lightning hooks ------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            environment.auto_requeue = False  # before Trainer._run registers its handlers, which read it
            rank_zero_info(
                "Preemption: Lightning's SLURM auto-requeue (a save inside the signal handler, Lightning#21406) "
                "is off; a signal is acted on at the next step boundary"
            )
        self._signal = self.requeue_signal or self._default_signal(environment)
        self._received, self._checked_step = {}, -1
        self._install()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registered its SIGTERM handler after setup (it broadcasts from inside the handler): ours again.
        self._install()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._checked_step:
            return  # accumulating gradients: not a step boundary (a save here would lose them)
        self._checked_step = trainer.global_step
        received = self._gather(trainer)
        if not any(received):
            return
        requeue_wanted = any(bits & _REQUEUE for bits in received)
        signum = self._signal if requeue_wanted else signal.SIGTERM
        who = ", ".join(
            f"rank {rank}: {'+'.join(n for b, n in ((_REQUEUE, self._signal.name), (_TERM, 'SIGTERM')) if bits & b)}"
            for rank, bits in enumerate(received)
            if bits
        )
        rank_zero_info(f"Preemption: {who}; saving at step {trainer.global_step} on all {len(received)} rank(s)")
        path = self._save(trainer)
        before = time.monotonic()  # SLURM's SIGTERM may come before scontrol has even returned
        if trainer.is_global_zero and self._requeue(signum, requeue_signal=requeue_wanted):
            self._await_slurm(since=before)
        raise Preempted(signum, path)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, Preempted):
            self._restore()
        # After our own save the handlers stay: SLURM's SIGTERM of the requeue may still come during teardown,
        # and the checkpoint is complete; recording it is all there is to do.

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore()

    # -- the pieces -----------------------------------------------------------------------------------------------

    def _default_signal(self, environment: Any) -> signal.Signals:
        if slurm.launched_by_submitit():
            return _signal_named(os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
        if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
            return _signal_named(int(environment.requeue_signal))
        return signal.SIGUSR1

    def _gather(self, trainer: pl.Trainer) -> list[int]:
        """What each rank received so far: one all_gather of one int per rank (nothing at all on one process)."""
        mine = (_REQUEUE if self._signal in self._received else 0) | (_TERM if signal.SIGTERM in self._received else 0)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [mine]
        device = trainer.strategy.root_device  # nccl needs the rank's GPU; gloo the CPU
        parts = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.tensor([mine], dtype=torch.int32, device=device))
        return torch.cat(parts).tolist()  # one copy to the host

    def _save(self, trainer: pl.Trainer) -> Path:
        strategy = trainer.strategy
        directory = Path(self.dirpath or trainer.default_root_dir)
        final = None
        if trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.glob(f".{HPC_PREFIX}*"):  # partial writes of a killed save
                remove_path(stale)
            final = str(directory / f"{HPC_PREFIX}{max(hpc_checkpoints(directory), default=0) + 1}.ckpt")
        final = Path(strategy.broadcast(final))  # one name for all ranks, whatever each one's view of the directory
        partial = partial_path(final)
        trainer.save_checkpoint(partial)  # every rank: sharded strategies write their part; ends in a barrier
        if trainer.is_global_zero:
            publish(partial, final)
            for older in hpc_checkpoints(directory).values():
                if older != final:
                    remove_path(older)  # superseded by a complete, newer one
        strategy.barrier("Preemption: checkpoint published")
        rank_zero_info(f"Preemption: saved {final}")
        return final

    def _await_slurm(self, since: float, timeout: float = 60.0) -> None:
        """After ``scontrol requeue``, leave the ending of this start to SLURM: wait for its SIGTERM (bounded).

        Exiting at once, the batch script ended before SLURM's kill, and once in 20 runs here the requeued job
        ended FAILED instead of pending again. Waiting for the kill leaves SLURM in charge of the order, as
        Lightning's handler does by training on. The other ranks may exit meanwhile: srun's step, and so the
        script, lasts while this rank does.
        """
        rank_zero_info("Preemption: waiting for SLURM to end this start of the requeued job")
        deadline = since + timeout
        while self._received.get(signal.SIGTERM, 0.0) <= since and time.monotonic() < deadline:
            time.sleep(0.05)

    def _requeue(self, signum: int, requeue_signal: bool) -> bool:
        """Rank 0, after the save: requeue on the requeue signal, or on SIGTERM when SLURM is preempting the job.

        True when ``scontrol requeue`` succeeded (SLURM will now end this start).
        """
        if requeue_signal and slurm.launched_by_submitit() and callable(previous := self._previous.get(signum)):
            # submitit's own handler decides (timeouts left, its pickled resubmission) and requeues; called here,
            # after the save, not from inside a signal.
            rank_zero_info("Preemption: submitit launched this job; its handler requeues it")
            try:
                previous(signum, None)  # requeues, then exits at once; raises UncompletedJobError if it will not
            except SystemExit:
                return True  # requeued: exit only once SLURM ends this start (_await_slurm), not at once
            except subprocess.CalledProcessError as err:  # its `scontrol requeue` (check_call)
                if slurm.ended_by_requeue(err.returncode):
                    rank_zero_info("Preemption: SLURM ended submitit's `scontrol requeue` as it took the requeue")
                    return True
                rank_zero_warn(
                    f"Preemption: submitit's requeue failed ({err}); the checkpoint is saved, resume by hand"
                )
            return False
        job = slurm.job_id()
        wanted = self.requeue if self.requeue is not None else job is not None
        if not wanted or job is None:
            rank_zero_info("Preemption: not requeueing (not in a SLURM job, or requeue=False); run the same command to resume")
            return False
        if not requeue_signal:
            # SIGTERM alone: scancel, the time limit, `scontrol requeue` (already requeued), or preemption, which
            # SLURM follows with a requeue only if the job outlives the grace time; ours has saved and exits.
            preempted, state = slurm.being_preempted(job)
            if not preempted:
                rank_zero_info(f"Preemption: SIGTERM, and job {job} is not being preempted (JobState={state}); not requeueing")
                return False
        if (why_not := slurm.requeue(job)) is None:
            rank_zero_info(f"Preemption: requeued SLURM job {job}")
            return True
        rank_zero_warn(f"Preemption: `scontrol requeue {job}` failed ({why_not}); the checkpoint is saved, resume by hand")
        return False
