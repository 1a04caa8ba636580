"""Surviving a kill (issue 5): a 2-process run killed with SIGKILL and restarted with
``ckpt_path=last`` goes on with exactly the losses of a run never interrupted.

The recipe runs as a user runs it (real Hydra, real Lightning, DDP over gloo on
CPU; the killed run through Lightning's launcher, the others with their ranks started
as torchrun starts them), dropout on, the uninterrupted run loading in the training process, the
killed one in 2 workers per rank (``data.num_workers`` 0 and 2). The kill lands at a random step, drawn
from a seed printed with the results; ``CKPT_RESUME_SEED=<seed> pytest
tests/test_resume.py`` replays it. Epochs are 6 steps and last.ckpt is written
every 3, so the resume point is mid-epoch or on an epoch's last batch depending
on the draw.
"""

from __future__ import annotations

import csv
import io
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import warm_python
from conftest import RECIPE
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader.sampler import BatchSampler

from ckpt_examples.data import EpochAwareDataLoader
from ckpt_plugin.runs.resume import ResumableRNG

MAX_STEPS = 16
EVERY = 3  # last.ckpt every 3 optimizer steps
EPOCH = 6  # batches per rank per epoch: 48 samples / 2 ranks / 4 per batch
RUN = [
    "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
    "model.n_layer=2", "model.n_embd=64", "data.block_size=32", "data.batch_size=4", "data.num_samples=48",
    f"trainer.max_steps={MAX_STEPS}", "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
    "callbacks=[activation_checkpointing,model_checkpoint]", f"callbacks.model_checkpoint.every_n_train_steps={EVERY}",
    "ckpt_path=last",  # the same command starts the run and restarts it
]  # fmt: skip
NO_LAST = 'ckpt_path="last") is set, but there is no last checkpoint available'
NOT_RESUMABLE = "your dataloader is not resumable"


def _command(logs: str, workers: int) -> list[str]:
    # Each start logs to its own folder (one metrics.csv each); checkpoints/ is the same for the killed run's restart.
    csv_logger = "_target_:lightning.pytorch.loggers.CSVLogger,name:'',version:'',flush_logs_every_n_steps:1"
    logger = f"{{{csv_logger},save_dir:{logs}}}"  # flushed every step: the kill watches it
    run = [*RUN, f"data.num_workers={workers}", f"trainer.logger={logger}"]
    return [sys.executable, str(RECIPE), f"hydra.run.dir=hydra/{logs}", *run]


def _start(cwd: Path, logs: str, workers: int) -> subprocess.Popen:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    with open(cwd / f"{logs}.out", "w") as out:  # the child keeps its own copy of the file
        # A session of its own: rank 1 is rank 0's child, the loader workers theirs; SIGKILL to the group takes all.
        return subprocess.Popen(
            _command(logs, workers), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _warm(cwd: Path, logs: str, workers: int) -> str:
    """The same command, its ranks started as torchrun starts them, each a fork of a process that imported
    torch and Lightning once (``warm_python.run_ranks``): the runs no signal reaches. Its output."""
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    proc = warm_python.run_ranks(_command(logs, workers)[1:], 2, cwd=cwd, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def _finish(proc: subprocess.Popen, cwd: Path, logs: str) -> str:
    proc.wait(timeout=300)
    out = (cwd / f"{logs}.out").read_text()
    assert proc.returncode == 0, out[-5000:]
    return out


def _losses(csv_file: Path) -> dict[int, str]:
    """{step: train_loss as written}, complete lines only (the file may be mid-write)."""
    if not csv_file.exists():
        return {}
    text = csv_file.read_text()
    rows = csv.DictReader(text[: text.rfind("\n") + 1].splitlines())
    return {int(r["step"]): r["train_loss"] for r in rows if r.get("train_loss")}


def _kill_group_at(proc: subprocess.Popen, csv_file: Path, step: int) -> int:
    """SIGKILL the run's process group once ``step`` is logged; the last step logged."""
    deadline = time.monotonic() + 300
    while max(_losses(csv_file), default=-1) < step:
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"step {step} not logged in 300 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    while True:  # rank 1 too: it is reaped by init, not by us
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "rank 1 outlived SIGKILL to its group"
        time.sleep(0.02)
    return max(_losses(csv_file))


@dataclass
class Runs:
    workers: int  # data.num_workers
    seed: int
    kill_step: int  # the step after whose log the kill was sent
    uninterrupted: dict[int, str]
    killed: dict[int, str]
    killed_rc: int
    resume_step: int  # global_step in last.ckpt when the restart began
    resumed: dict[int, str]
    killed_out: str = field(repr=False)
    resumed_out: str = field(repr=False)

    def __str__(self) -> str:
        end = "the last batch of an epoch" if self.resume_step % EPOCH == 0 else "mid-epoch"
        killed = f"killed after step {self.kill_step}, resumed from step {self.resume_step} ({end})"
        return f"num_workers={self.workers}, seed {self.seed}: {killed}"


# The killed run loads in worker processes (whose base seed and queued batches the state holds), the uninterrupted
# one in the training process: one restart covers both (its losses must equal those without workers). Loading in
# the training process is resumed in-process below, every pattern of stops (two more launches cost a minute).
WORKERS = [2]


def _killed_then_resumed(cwd: Path, workers: int, kill_step: int, seed: int) -> Runs:
    proc = _start(cwd, "logs_killed", workers)
    _kill_group_at(proc, cwd / "logs_killed" / "metrics.csv", kill_step)
    resume_step = torch.load(cwd / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    resumed_out = _warm(cwd, "logs_resumed", workers)
    return Runs(
        workers=workers,
        seed=seed,
        kill_step=kill_step,
        uninterrupted={},  # filled in once the uninterrupted run has finished
        killed=_losses(cwd / "logs_killed" / "metrics.csv"),
        killed_rc=proc.returncode,
        killed_out=(cwd / "logs_killed.out").read_text(),
        resume_step=resume_step,
        resumed=_losses(cwd / "logs_resumed" / "metrics.csv"),
        resumed_out=resumed_out,
    )


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Runs]:
    """The uninterrupted run and, for each ``data.num_workers``, a killed run and its restart, side by side.

    The killed run is started as a user starts it (a new interpreter; Lightning's launcher starts rank 1 as
    another, and SIGKILL reaches the process group); the uninterrupted run and the restart, which no signal
    reaches, fork both ranks from a warm process. The two at once keep both cores busy. The kill still lands
    on its drawn step.
    """
    seed = int(os.environ.get("CKPT_RESUME_SEED", time.time_ns() % 1_000_000))
    draw = random.Random(seed)
    kill_steps = {w: draw.randint(EVERY + 1, MAX_STEPS - 3) for w in WORKERS}  # after a last.ckpt, before the end
    print(f"test_resume: seed {seed} (CKPT_RESUME_SEED={seed} replays it), kill after steps {kill_steps}")
    # One uninterrupted run serves both: worker processes change no number (asserted below).
    plain = tmp_path_factory.mktemp("uninterrupted")
    dirs = {w: tmp_path_factory.mktemp(f"killed{w}") for w in WORKERS}  # here: the factory is not thread-safe
    with ThreadPoolExecutor(len(WORKERS) + 1) as pool:
        uninterrupted = pool.submit(_warm, plain, "logs", 0)
        futures = {w: pool.submit(_killed_then_resumed, dirs[w], w, kill_steps[w], seed) for w in WORKERS}
        assert NO_LAST in uninterrupted.result()
        results = {w: future.result() for w, future in futures.items()}
    for result in results.values():
        result.uninterrupted = _losses(plain / "logs" / "metrics.csv")
        print(result)
    return results


@pytest.fixture(params=WORKERS, ids=lambda n: f"num_workers={n}")
def runs(request: pytest.FixtureRequest, all_runs: dict[int, Runs]) -> Runs:
    return all_runs[request.param]


def test_resumed_run_has_the_uninterrupted_losses(runs: Runs) -> None:
    assert sorted(runs.uninterrupted) == list(range(MAX_STEPS)), runs
    assert sorted(runs.resumed) == list(range(runs.resume_step, MAX_STEPS)), runs
    # Bitwise: the same ops in the same order on the same processes (the CSV holds each float's repr).
    diff = {s: (runs.uninterrupted[s], loss) for s, loss in runs.resumed.items() if loss != runs.uninterrupted[s]}
    assert not diff, f"{runs}: steps whose loss differs (uninterrupted, resumed): {diff}"


def test_resume_started_mid_training_from_the_killed_runs_checkpoint(runs: Runs) -> None:
    assert runs.killed_rc == -signal.SIGKILL, runs
    assert 0 < runs.resume_step < MAX_STEPS and runs.resume_step % EVERY == 0, runs
    assert runs.resume_step <= max(runs.killed) + 1, runs  # a checkpoint of the killed run, not a later one
    assert "Restored all states from the checkpoint at" in runs.resumed_out and "last.ckpt" in runs.resumed_out
    assert NOT_RESUMABLE not in runs.resumed_out, runs


def test_ckpt_path_last_without_a_checkpoint_starts_afresh(runs: Runs) -> None:
    assert NO_LAST in runs.killed_out, runs
    assert min(runs.killed) == 0, runs
    # Equal to the uninterrupted run's (num_workers=0) also with num_workers=2: workers change no number.
    assert runs.killed == {s: runs.uninterrupted[s] for s in runs.killed}, runs


# -- the two pieces in-process: fast, and every case rather than one random draw --------------------------------------

class _Indexed(Dataset):
    """Each sample's index and the seed of the process that read it: batches show the order and the worker seeding."""

    def __len__(self) -> int:
        return 42  # 7 batches an epoch for each kind of loader below

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, torch.initial_seed() % 2**62  # a worker's: its base seed + its id; fits collate's int64


DATA = _Indexed()


def _loader(kind: str, workers: int) -> EpochAwareDataLoader:
    if kind == "distributed":
        # As Lightning rebuilds it under DDP: torchdata's BatchSampler around a shuffled DistributedSampler, so that
        # the sampler's epoch matters (and ``loader.sampler`` is left a SequentialSampler).
        sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
        return EpochAwareDataLoader(DATA, batch_sampler=BatchSampler(sampler, 3, False), num_workers=workers)
    return EpochAwareDataLoader(DATA, batch_size=6, num_workers=workers)


def _batches(loader: EpochAwareDataLoader, start: int, stop: int) -> list[list[list[int]]]:
    """Batches ``start`` to ``stop`` (counted across epochs), drawn as Lightning's fit loop draws them."""
    epoch, out = start // len(loader), []
    it = iter(loader)  # on (re)start: iter() first (FitLoop.setup_data), the sampler's epoch after
    _set_sampler_epoch(loader, epoch)
    for i in range(start, stop):
        if i > start and i % len(loader) == 0:  # an epoch is len() batches: the loop never meets StopIteration
            epoch += 1
            _set_sampler_epoch(loader, epoch)  # between epochs: the sampler's epoch first, then iter()
            it = iter(loader)
        out.append([column.tolist() for column in next(it)])
    return out


# Every pattern of stops without workers; with two workers, an epoch's last batch and two restarts. A loader with
# workers costs tens of seconds a test here, nearly all of it waiting on its workers' shutdown, once per iterator
# (the suite's longest file ran 430 s for the ten of them); the workers change no batch (test_resumed_run_... above).
STOPS = [([5], 0), ([7], 0), ([14], 0), ([3, 5], 0), ([8, 17], 0), ([7], 2), ([8, 17], 2)]


@pytest.mark.parametrize("kind", ["sequential", "distributed"])
@pytest.mark.parametrize("stops, workers", STOPS,
                         ids=[f"{'-'.join(map(str, s))}-num_workers={w}" for s, w in STOPS])
def test_loader_resumes_where_it_stopped(kind: str, workers: int, stops: list[int]) -> None:
    """Killed after ``stops[0]`` batches (7: an epoch's last), restored, maybe killed and restored again."""
    torch.manual_seed(0)
    expected = _batches(_loader(kind, workers), 0, 21)
    seen: list[list[list[int]]] = []
    state, done = None, 0
    for stop in [*stops, 21]:
        torch.manual_seed(0)  # a restarted process: the same seed, then draws of its own before the loader is made
        torch.rand(stop)
        loader = _loader(kind, workers)
        if state is not None:
            loader.load_state_dict(torch.load(_saved(state), weights_only=True))  # as Lightning loads a checkpoint
        seen += _batches(loader, done, stop)
        done, state = stop, loader.state_dict()
    assert seen == expected


def test_loader_refuses_shuffle() -> None:
    with pytest.raises(ValueError, match=r"EpochAwareDataLoader\(shuffle=True\) would not resume exactly"):
        EpochAwareDataLoader(DATA, batch_size=6, shuffle=True)


def _saved(obj: object) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def _draws() -> tuple[torch.Tensor, list[float], float]:
    return torch.rand(3), np.random.rand(3).tolist(), random.random()


def test_rng_states_come_back_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    callback = ResumableRNG()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    torch.save({"rng": callback.state_dict()}, tmp_path / "last.ckpt")
    saved = _draws()

    torch.manual_seed(8), np.random.seed(8), random.seed(8)
    callback.load_state_dict(torch.load(tmp_path / "last.ckpt", weights_only=True)["rng"])  # Lightning's default
    callback.on_train_start(SimpleNamespace(world_size=1, global_rank=0), None)
    restored = _draws()
    assert torch.equal(restored[0], saved[0]) and restored[1:] == saved[1:]


def test_rng_states_of_another_world_size_warn_and_are_left_alone() -> None:
    callback = ResumableRNG()
    callback.load_state_dict({"ranks": callback.state_dict()["ranks"] * 2})
    torch.manual_seed(8)
    with pytest.warns(UserWarning, match="the checkpoint holds the random states of 2 process"):
        callback.on_train_start(SimpleNamespace(world_size=1, global_rank=0), None)
    left_alone = torch.rand(3)
    torch.manual_seed(8)
    assert torch.equal(left_alone, torch.rand(3))
