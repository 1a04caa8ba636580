"""Preemption in one process: a real signal at each point of a step, the save at the step boundary, exact resume.

The SLURM side (requeue, two ranks, SIGTERM with a grace time, SIGKILL mid-save) is in
tests/test_slurm.py; here, what needs no cluster: every run is a real Lightning Trainer,
every signal a real ``os.kill`` of this process (tests/preempt_faults.py), every resume a
real ``fit(ckpt_path=...)`` whose final weights must equal, bitwise, those of a run never
interrupted (dropout on: the random streams come back through ``ResumableRNG``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import small_gpt
from preempt_faults import SendSignal
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ckpt_plugin import ActivationCheckpointing, AtomicCheckpointIO, Preempted, Preemption, ResumableRNG
from ckpt_plugin.runs.atomic import atomic_path, partial_path, publish
from ckpt_plugin.runs.preemption import hpc_checkpoints
from ckpt_plugin.runs.resume import latest_checkpoint

STEPS = 8


def _loader(model) -> StatefulDataLoader:
    g = torch.Generator().manual_seed(0)
    T, V = model.hparams.block_size, model.hparams.vocab_size
    data = torch.randint(V, (24, T + 1), generator=g)  # 12 batches: the epoch outlasts the run
    return StatefulDataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2)


def _fit(root: Path, *extra: pl.Callback, ckpt_path: str | None = None, accumulate: int = 1, steps: int = STEPS):
    pl.seed_everything(3)
    model = small_gpt(seed=3, dropout=0.1)
    callbacks = [ActivationCheckpointing(layers="TransformerBlock"), Preemption(), ResumableRNG(), *extra]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=callbacks, default_root_dir=root, accumulate_grad_batches=accumulate,
        plugins=[AtomicCheckpointIO()],
    )  # fmt: skip
    trainer.fit(model, _loader(model), ckpt_path=ckpt_path)
    return trainer, model


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return {acc: _fit(tmp_path_factory.mktemp(f"plain{acc}"), accumulate=acc)[1] for acc in (1, 2)}


@pytest.mark.parametrize(
    ("at", "sig"),
    [("backward", "SIGUSR1"), ("optimizer_step", "SIGUSR1"), ("save", "SIGUSR1"), ("backward", "SIGTERM")],
)
def test_a_signal_anywhere_in_a_step_saves_at_its_end_and_the_resume_is_exact(
    tmp_path: Path, uninterrupted, at: str, sig: str
) -> None:
    fault = SendSignal(at=at, step=3, signal=sig)
    extra: list[pl.Callback] = [fault]
    if at == "save":  # a save to be inside: Lightning's own, at step 3
        extra.append(_SaveAt(3, tmp_path / "other.ckpt"))
    with pytest.raises(Preempted) as stopped:
        _fit(tmp_path, *extra)
    assert fault.sent == [3]
    signum = signal.Signals[sig]
    assert stopped.value.code == 128 + signum and stopped.value.signum == signum
    # The step the signal landed in finished; the checkpoint holds it, complete, under its final name.
    assert stopped.value.path == tmp_path / "hpc_ckpt_1.ckpt"
    assert torch.load(stopped.value.path, weights_only=False)["global_step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing partial left

    trainer, resumed = _fit(tmp_path, ckpt_path=str(stopped.value.path))
    assert trainer.global_step == STEPS
    _assert_same_weights(resumed, uninterrupted[1])


class _SaveAt(pl.Callback):
    """Lightning's own ``trainer.save_checkpoint`` at the end of one step, as ModelCheckpoint does."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_with_gradient_accumulation_it_waits_for_the_optimizer_step(tmp_path: Path, uninterrupted) -> None:
    # Step 3 is batches 6 and 7; the signal comes in batch 6's backward, half-way through accumulating.
    fault = SendSignal(at="backward", step=3)
    with pytest.raises(Preempted) as stopped:
        _fit(tmp_path, fault, accumulate=2)
    saved = torch.load(stopped.value.path, weights_only=False)
    assert saved["global_step"] == 4  # not 3 and a half: the accumulated gradient would be lost
    _, resumed = _fit(tmp_path, ckpt_path=str(stopped.value.path), accumulate=2)
    _assert_same_weights(resumed, uninterrupted[2])


def test_a_second_preemption_supersedes_the_first(tmp_path: Path, uninterrupted) -> None:
    with pytest.raises(Preempted) as first:
        _fit(tmp_path, SendSignal(at="backward", step=2))
    with pytest.raises(Preempted) as second:
        _fit(tmp_path, SendSignal(at="optimizer_step", step=5), ckpt_path=str(first.value.path))
    assert second.value.path == tmp_path / "hpc_ckpt_2.ckpt"
    assert hpc_checkpoints(tmp_path) == {2: second.value.path}  # the older one is removed once this one is complete
    _, resumed = _fit(tmp_path, ckpt_path=str(second.value.path))
    _assert_same_weights(resumed, uninterrupted[1])


def test_handlers_are_restored_after_fit(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    _fit(tmp_path, steps=2)
    assert {s: signal.getsignal(s) for s in before} == before


def test_without_a_signal_nothing_is_saved(tmp_path: Path) -> None:
    _fit(tmp_path, steps=2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("SIGUSR3", "Preemption(requeue_signal='SIGUSR3'): not a signal; choose one of "),
        ("SIGTERM", "Preemption(requeue_signal='SIGTERM'): SIGTERM is always handled (it means: save and stop)"),
        ("KILL", "Preemption(requeue_signal='KILL'): SIGKILL cannot be caught; choose one of "),
    ],
)
def test_a_signal_that_cannot_be_the_requeue_signal_is_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        Preemption(requeue_signal=value)
    assert str(err.value).startswith(message)
    assert "SIGUSR2" in str(err.value)


def test_signal_names_are_read_as_users_write_them() -> None:
    assert Preemption(requeue_signal="usr2").requeue_signal == signal.SIGUSR2
    assert Preemption(requeue_signal="SIGUSR1").requeue_signal == signal.SIGUSR1
    assert Preemption(requeue_signal=int(signal.SIGHUP)).requeue_signal == signal.SIGHUP


# -- atomic writes ----------------------------------------------------------------------------------------------------


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    final = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, final)
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(final) as partial:
        partial.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert torch.load(final, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_sharded_directory_is_published_whole(tmp_path: Path) -> None:
    final = tmp_path / "hpc_ckpt_1.ckpt"
    for version in (1, 2):
        partial = partial_path(final)
        partial.mkdir()
        for rank in range(2):
            (partial / f"rank{rank}.pt").write_text(f"v{version}")
        publish(partial, final)
        assert sorted(p.read_text() for p in final.iterdir()) == [f"v{version}"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_1.ckpt"]


_KILLED_MID_WRITE = """
import os, signal, sys, torch
from ckpt_plugin import AtomicCheckpointIO

class KillWhilePickled:  # torch.save reaches it after writing the tensors before it
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

io = AtomicCheckpointIO()
io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, sys.argv[1])
io.save_checkpoint({"step": 2, "w": torch.ones(1_000_000), "x": KillWhilePickled()}, sys.argv[1])
"""


def test_sigkill_in_the_middle_of_a_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    final = tmp_path / "last.ckpt"
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, str(final)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = partial_path(final)
    assert partial.exists()  # the killed write, never renamed
    assert torch.load(final, weights_only=True)["step"] == 1
    assert latest_checkpoint_of(tmp_path) == str(final)


def latest_checkpoint_of(directory: Path) -> str | None:
    trainer = pl.Trainer(
        default_root_dir=directory, logger=False, enable_progress_bar=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=directory, save_last=True)],
    )  # fmt: skip
    return latest_checkpoint(trainer)


class _Fails(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        raise RuntimeError("a bug in the user's code")


def test_after_a_failed_fit_signals_reach_the_handler_that_was_there_before(tmp_path: Path) -> None:
    """Lightning's teardown may put our handler back (it was there when Lightning registered): disarmed, it passes on."""
    received: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        with pytest.raises(RuntimeError, match="a bug in the user's code"):
            _fit(tmp_path, _Fails(), steps=2)
        signal.raise_signal(signal.SIGUSR1)
        assert received == [signal.SIGUSR1]
        assert list(tmp_path.iterdir()) == []  # and nothing was saved for it
    finally:
        signal.signal(signal.SIGUSR1, before)


def _scontrol(bin_dir: Path, body: str) -> None:
    """An ``scontrol`` first on PATH: what SLURM's own does in a race that cannot be timed from a test."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "scontrol").chmod(0o755)


@pytest.mark.parametrize("launcher", ["scontrol", "submitit"])
def test_scontrol_ended_by_the_requeues_own_sigterm_is_a_requeue(tmp_path: Path, monkeypatch, caplog, launcher) -> None:
    """``scontrol requeue`` runs inside the job, so SLURM's SIGTERM of the requeue it took can end it first (seen in
    CI: submitit's check_call raised with -15, the job started again). A requeue, not a failure; a refusal stays one."""
    import submitit
    from submitit.core.job_environment import SignalHandler
    from submitit.slurm.slurm import SlurmJobEnvironment

    from ckpt_plugin.runs import slurm

    _scontrol(tmp_path / "bin", "kill -TERM $$")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    job = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1"}
    for key, value in {**job, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "vm"}.items():
        monkeypatch.setenv(key, value)
    preemption = Preemption()
    if launcher == "submitit":  # submitit's real handler, as its job script installs it
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        delayed = submitit.helpers.DelayedSubmission(submitit.helpers.FunctionSequence())  # has .checkpoint
        delayed.set_timeout(60, 3)
        paths = submitit.core.utils.JobPaths(tmp_path / "jobs", job_id="7")
        paths.folder.mkdir(parents=True)
        handler = SignalHandler(SlurmJobEnvironment(), paths, delayed)
        preemption._previous[signal.SIGUSR2] = handler.checkpoint_and_try_requeue
        signum, said = signal.SIGUSR2, "SLURM ended submitit's `scontrol requeue` as it took the requeue"
    else:
        signum, said = signal.SIGUSR1, "Preemption: requeued SLURM job 7"
    with caplog.at_level("INFO"):
        assert preemption._requeue(signum, requeue_signal=True) is True
    assert said in caplog.text
    assert slurm.requeue("7") is None

    _scontrol(tmp_path / "bin", "echo 'Requested operation is presently disabled' >&2; exit 1")
    assert slurm.requeue("7") == (
        "exited 1: Requested operation is presently disabled (is the job submitted with --requeue?)"
    )
    with pytest.warns(UserWarning, match=r"requeue.* failed .*the checkpoint is saved, resume by hand"):
        assert preemption._requeue(signum, requeue_signal=True) is False
