"""The SLURM recipes and the submitit launcher config, run by a real SLURM on this machine.

A module fixture brings up munged, slurmctld and slurmd (tests/slurm_cluster.py); each test
submits as a user would, with the command-line options that fit a CPU node (two tasks, one
core each, no GPUs) and a tiny model, then reads what the job wrote. Skipped, with the reason,
where a local SLURM cannot run (not root; not installed and installing not allowed).

The preemption tests send every signal a job meets (SIGUSR1 before the time limit, SIGTERM of
a real preemption, signals inside backward, the optimizer step and a save, to one rank only,
SIGKILL mid-save, three requeues of one job, submitit's own signal) and require the weights of an
uninterrupted run at the end. No job runs for one check alone: the job that a higher-priority job
preempts is the multi-node recipe's, and the single-node recipe's uninterrupted run is the reference.
``python tests/slurm_loop.py`` repeats one of them N times.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
import torch
from conftest import CONFIGS, RECIPE, ROOT, STARTUP
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

RECIPES = ROOT / "recipes" / "slurm"
# sbatch options win over the recipe's #SBATCH lines: a CPU node with two cores and no GPUs.
CPU_NODE = ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1"]
TINY = ["model.n_layer=2", "model.n_embd=64", "data.block_size=32", "trainer.enable_progress_bar=false"]
STOPPED = "`Trainer.fit` stopped: `max_steps={}` reached."
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


@pytest.fixture(scope="module")
def cluster():
    if reason := slurm_cluster.unavailable():
        pytest.skip(reason)
    with slurm_cluster.running_cluster() as running:
        yield running


def test_launcher_config_extends_the_plugin_schema() -> None:
    """hydra/launcher=slurm composes onto submitit_slurm's typed schema (no SLURM needed)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", ["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], return_hydra_config=True)
        launcher = cfg.hydra.launcher
        assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
        assert (launcher.timeout_min, launcher.gpus_per_node, launcher.signal_delay_s) == (240, 1, 90)
        assert launcher.partition == "gpu" and launcher.array_parallelism == 256  # ours, then the plugin's default
        with pytest.raises(ConfigCompositionException, match="hydra.launcher.timeout_min=soon"):
            compose("train", ["hydra/launcher=slurm", "hydra.launcher.timeout_min=soon"], return_hydra_config=True)


def _env(cluster: slurm_cluster.Cluster) -> dict[str, str]:
    # The job inherits this environment (sbatch --export=ALL): the recipe's `python` is this one.
    path = f"{Path(sys.executable).parent}{os.pathsep}{cluster.env['PATH']}"
    faults = str(ROOT / "tests")  # preempt_faults, for the preemption tests' +callbacks overrides
    # STARTUP first, as in every interpreter the suite starts: the test environment's torchvision (conftest.py)
    pythonpath = os.pathsep.join([str(STARTUP), faults])
    return cluster.env | {"PATH": path, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}


def _sbatch(cluster, recipe: str, out: Path, options: list[str], overrides: list[str]):
    """Submit a recipe from the repository root; outputs, checkpoints and the Hydra dir under ``out``.

    sbatch returns at once and prints the job id (--parsable). Not `sbatch --wait`: it looks at the job only
    every 2 s, and may take a requeue for the end of the job.
    """
    cmd = [
        "sbatch", "--parsable", f"--output={out}/%x-%j.out", *CPU_NODE, *options,
        str(RECIPES / recipe), "trainer.accelerator=cpu", *TINY, f"hydra.run.dir={out}/run",
        f"callbacks.model_checkpoint.dirpath={out}/checkpoints", f"++trainer.default_root_dir={out}", *overrides,
    ]  # fmt: skip
    pipe, merged = subprocess.PIPE, subprocess.STDOUT
    return subprocess.run(cmd, cwd=ROOT, env=_env(cluster), text=True, stdout=pipe, stderr=merged, timeout=300)


def _job_output(out: Path) -> tuple[str, str]:
    """The job id and what the job wrote (one output file per job, named by --output)."""
    (path,) = out.glob("*.out")
    return path.stem.rsplit("-", 1)[1], path.read_text()


def _report(capsys, name: str, info: dict[str, str], seconds: float) -> None:
    with capsys.disabled():
        print(f"\n{name}: job {info['JobId']} {info['JobState']} RunTime={info['RunTime']}, "
              f"submit to exit {seconds:.1f} s")  # fmt: skip


def _assert_ranks_trained(text: str, steps: int) -> None:
    # Two processes started by srun, each one rank of one process group.
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in text, text[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in text, text[-3000:]
    assert "All distributed processes registered. Starting with 2 processes" in text
    assert "distributed_backend=gloo" in text
    # Lightning saw SLURM (SLURMEnvironment); Preemption switched its in-handler save off before it armed it.
    assert "Preemption: Lightning's SLURM auto-requeue (a save inside the signal handler" in text
    assert "SLURM auto-requeueing enabled" not in text
    # The plugin wrapped both TransformerBlocks; rank zero prints its table once.
    table = re.search(r"Activation checkpointing wrapped (\d+) module\(s\) of GPT \(ckpt=full\);.*?\n((?:  .*\n)+)", text)
    assert table and table[1] == "2", text[-3000:]
    assert re.findall(r"^  (blocks\.\d)\s+TransformerBlock", table[2], re.M) == ["blocks.0", "blocks.1"]
    assert text.count(STOPPED.format(steps)) == 1


def test_single_node_recipe_trains_two_ranks(uninterrupted_job, capsys) -> None:
    """The single-node recipe as submitted for the preemption tests' reference run, never interrupted."""
    info, text, out = uninterrupted_job
    _report(capsys, "single_node.sbatch", info, float(info["seconds"]))
    assert (info["JobState"], info["ExitCode"], info["NumNodes"], info["NumTasks"]) == ("COMPLETED", "0:0", "1", "2")
    _assert_ranks_trained(text, steps=STEPS)
    assert OmegaConf.load(out / "run" / ".hydra" / "config.yaml").trainer.devices == 2


def _wait_for(what: str, check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


# -- preemption: a signal sets a flag, all ranks save at the next step boundary, rank 0 requeues -----------------------
# Every run below trains the same STEPS steps as the uninterrupted job of the `uninterrupted` fixture and must end
# with its weights, bitwise. Faults inside a step come from tests/preempt_faults.py (a real os.kill of the rank's own
# process at a chosen point); signals from outside come from SLURM itself (scancel --signal, a preempting job).

STEPS = 30
LAST_EVERY = 10  # ModelCheckpoint's last.ckpt, the resume point older than any preemption checkpoint
PREEMPT = [f"trainer.max_steps={STEPS}", f"callbacks.model_checkpoint.every_n_train_steps={LAST_EVERY}"]
# Time for a signal from outside, sent once the first last.ckpt exists: 0.05 s a step from then on, in the first start.
THROTTLE = f"+callbacks.throttle={{_target_:preempt_faults.Throttle,seconds:0.05,start:0,after:{LAST_EVERY}}}"
SAVING = re.compile(r"Preemption: (.*); saving at step (\d+) on all 2 rank\(s\)")


def _only(who: str, signal_name: str) -> bool:
    """Whether Preemption's "rank 0: X, rank 1: X" names one or both ranks, each with ``signal_name`` alone."""
    return re.fullmatch(rf"rank [01]: {signal_name}(, rank 1: {signal_name})?", who) is not None


def _fault(name: str, **keys) -> str:
    """A Hydra override adding a preempt_faults.SendSignal callback."""
    body = ",".join(f"{k}:{v}" for k, v in keys.items())
    return f"+callbacks.{name}={{_target_:preempt_faults.SendSignal,{body}}}"


def _run_preempted(
    cluster,
    out: Path,
    overrides: list[str],
    *,
    recipe: str = "single_node.sbatch",
    options: tuple[str, ...] = (),
    during=None,
    timeout: float = 240.0,
):
    """Submit ``recipe``, call ``during(job_id)`` once it runs, release every requeue, wait for the end.

    SLURM holds a requeued batch job back for about two minutes (its BeginTime, the job credential's
    lifetime plus 1 s): each time the job is PENDING again with one more restart, it is released at once.
    Returns scontrol's record of the job and everything the job printed.
    """
    start = time.monotonic()
    proc = _sbatch(cluster, recipe, out, list(options), [*PREEMPT, *overrides])
    assert proc.returncode == 0, proc.stdout
    job_id = proc.stdout.strip().split(";")[0]
    if during is not None:
        _wait_for(f"job {job_id} to run", lambda: slurm_cluster.job_info(cluster, job_id)["JobState"] == "RUNNING")
        during(job_id)
    released, info = 0, {}
    deadline = start + timeout
    while (info := slurm_cluster.job_info(cluster, job_id))["JobState"] not in FINISHED:
        restarts = int(info.get("Restarts", "0"))
        if info["JobState"] == "PENDING" and restarts > released:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster.env, check=True)
            released = restarts
        if time.monotonic() > deadline:
            _, text = _job_output(out)
            raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout:.0f} s:\n{text[-4000:]}")
        time.sleep(0.2)
    _, text = _job_output(out)  # --open-mode=append: every start in one file
    info["seconds"] = f"{time.monotonic() - start:.1f}"
    info["log_tail"] = cluster.log_tail(30)  # the daemons' view, for a failure message
    return info, text


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == STEPS
    return saved["state_dict"]


def _assert_finished_like_uninterrupted(info: dict, text: str, out: Path, uninterrupted, restarts: int) -> None:
    state = (info["JobState"], info["ExitCode"], info["Restarts"])
    assert state == ("COMPLETED", "0:0", str(restarts)), f"{text[-5000:]}\n{info.get('log_tail', '')}"
    assert "Handling auto-requeue signal" not in text  # Lightning's in-handler save never ran
    assert text.count(STOPPED.format(STEPS)) == 1  # only the last start reached the end
    weights = _final_weights(out)
    assert weights.keys() == uninterrupted.keys()
    differ = [name for name in weights if not torch.equal(weights[name], uninterrupted[name])]
    assert not differ, f"weights differ from the uninterrupted run's: {differ}"


@pytest.fixture(scope="module")
def uninterrupted_job(cluster, tmp_path_factory) -> tuple[dict, str, Path]:
    """single_node.sbatch with the preemption tests' settings and no fault: its record, output and directory."""
    out = tmp_path_factory.mktemp("uninterrupted")
    info, text = _run_preempted(cluster, out, [])
    return info, text, out


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_job) -> dict[str, torch.Tensor]:
    """The weights every preempted run must end with."""
    info, text, out = uninterrupted_job
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), text[-5000:]
    assert "saving at step" not in text
    return _final_weights(out)


def test_sigterm_of_a_preemption_saves_within_the_grace_time_and_the_job_comes_back(
    cluster, tmp_path: Path, capsys, uninterrupted
):
    """A job of the higher-priority partition takes the CPUs: SIGTERM, GraceTime=5, then SIGKILL (slurm_cluster).

    The preempted job is the multi-node recipe's, and this is that recipe's test too. The reference is the
    single-node recipe's run: the two scripts start the same training with the same srun line.
    """

    def preempt(job_id: str) -> None:
        _wait_for("the first last.ckpt", (tmp_path / "checkpoints" / "last.ckpt").exists)
        urgent = ["sbatch", "--parsable", "--partition=urgent", "--ntasks=1", "--output=/dev/null", "--wrap", "true"]
        subprocess.run(urgent, env=cluster.env, check=True, capture_output=True)

    info, text = _run_preempted(
        cluster, tmp_path, [THROTTLE], recipe="multi_node.sbatch", options=("--nodes=1",), during=preempt
    )  # one node: one slurmd a host
    _report(capsys, "multi_node.sbatch, preempted", info, float(info["seconds"]))
    _assert_finished_like_uninterrupted(info, text, tmp_path, uninterrupted, restarts=1)
    assert (info["JobName"], info["NumNodes"], info["NumTasks"]) == ("ckpt-train-multi", "1", "2")
    _assert_ranks_trained(text, steps=STEPS)
    assert OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml").trainer.devices == 2
    ((who, _),) = SAVING.findall(text)
    assert _only(who, "SIGTERM"), text[-3000:]
    # Exited before the grace time ended, so SLURM would not requeue it: rank 0 did, seeing PreemptTime set.
    assert f"Preemption: requeued SLURM job {info['JobId']}" in text
    assert re.findall(r"Restored all states from the checkpoint at (\S+)", text) == [str(tmp_path / "hpc_ckpt_1.ckpt")]


def test_requeued_three_times_by_signals_in_backward_the_optimizer_step_and_a_save(
    cluster, tmp_path: Path, capsys, uninterrupted
):
    faults = [
        _fault("first", at="backward", step=7, ranks="[0]", start=0),  # rank 1 is in DDP's all-reduce meanwhile
        _fault("second", at="optimizer_step", step=18, ranks="[1]", start=1),
        # ModelCheckpoint saves last.ckpt at the end of step 20; the signal lands inside that save, on both ranks.
        _fault("third", at="save", step=2 * LAST_EVERY, start=2),
    ]
    info, text = _run_preempted(cluster, tmp_path, faults)
    _report(capsys, "requeued three times", info, float(info["seconds"]))
    _assert_finished_like_uninterrupted(info, text, tmp_path, uninterrupted, restarts=3)
    # All ranks stopped at the same boundary: the end of the step each signal landed in (after the save it was in).
    assert SAVING.findall(text) == [
        ("rank 0: SIGUSR1", "8"), ("rank 1: SIGUSR1", "19"), ("rank 0: SIGUSR1, rank 1: SIGUSR1", "21"),
    ], text[-3000:]  # fmt: skip
    restored = re.findall(r"Restored all states from the checkpoint at (\S+)", text)
    assert restored == [str(tmp_path / f"hpc_ckpt_{n}.ckpt") for n in (1, 2, 3)]
    assert not (tmp_path / "hpc_ckpt_1.ckpt").exists()  # superseded once a newer one was complete


def test_requeue_signal_mid_save_then_sigkill_leaves_the_previous_checkpoint(
    cluster, tmp_path: Path, capsys, uninterrupted
):
    """What --signal=SIGUSR1@90 does before the time limit, sent now to every task (as SLURM sends it); the save it
    starts stalls half-written, and `scontrol requeue` SIGTERMs and, KillWait later, SIGKILLs the job. The second
    start resumes from the last complete checkpoint and finishes with the uninterrupted run's weights.

    (One job for both: a signal from outside at a step boundary, and a save that never completes. The save that
    completes, rank 0's requeue and the resume from it: the SIGTERM and three-requeue tests.)"""
    partial = tmp_path / ".hpc_ckpt_1.ckpt.partial"
    seen = {}

    def signal_then_kill_mid_save(job_id: str) -> None:
        _wait_for("the first last.ckpt", (tmp_path / "checkpoints" / "last.ckpt").exists)
        subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster.env, check=True)  # as SLURM does
        _wait_for("half of the preemption checkpoint", lambda: partial.exists() and partial.stat().st_size > 0)
        seen["bytes"] = partial.stat().st_size
        subprocess.run(["scontrol", "requeue", job_id], env=cluster.env, check=True)

    overrides = [THROTTLE, "trainer.plugins=[{_target_:preempt_faults.StallingCheckpointIO}]"]
    info, text = _run_preempted(cluster, tmp_path, overrides, during=signal_then_kill_mid_save)
    _report(capsys, "requeue signal, SIGKILL mid-save", info, float(info["seconds"]))
    _assert_finished_like_uninterrupted(info, text, tmp_path, uninterrupted, restarts=1)
    ((who, step),) = SAVING.findall(text)
    # scancel signals the tasks one after the other: at the boundary one rank may have it, and all stop there.
    assert _only(who, "SIGUSR1") and LAST_EVERY <= int(step) < STEPS, text[-3000:]
    assert seen["bytes"] > 0 and "stalling" in text
    assert not (tmp_path / "hpc_ckpt_1.ckpt").exists()  # never renamed: nothing half-written under a final name
    # The second start took the previous complete checkpoint (last.ckpt, of step 10 or 20) and redid the steps after.
    restored = re.findall(r"Restored all states from the checkpoint at (\S+)", text)
    assert restored == [str(tmp_path / "checkpoints" / "last.ckpt")]


def test_submitit_sweep_runs_one_job_per_value(cluster, tmp_path: Path, capsys) -> None:
    """hydra/launcher=slurm: submitit submits the sweep as a job array through sbatch and waits for it."""
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable, str(RECIPE), "--multirun", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
        "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", *TINY, "trainer.max_steps=3",
        "ckpt.every_n=1,2",
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(cluster), capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    with capsys.disabled():
        print(f"\nsubmitit sweep of 2 jobs: {seconds:.1f} s")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    (script,) = (sweep / ".submitit").glob("*/*_submission.sh")
    assert "#SBATCH --array=0-1%2" in script.read_text()  # one array, a task per swept value
    array_id = script.parent.name
    wrapped = {}
    for num in (0, 1):
        every_n = OmegaConf.load(sweep / str(num) / ".hydra" / "config.yaml").ckpt.every_n
        log = (sweep / ".submitit" / f"{array_id}_{num}" / f"{array_id}_{num}_0_log.err").read_text()
        assert STOPPED.format(3) in log, log[-3000:]
        wrapped[every_n] = int(re.search(r"wrapped (\d+) module\(s\) of GPT", log)[1])
    assert wrapped == {1: 2, 2: 1}  # every block, then every second block of the two


def test_a_submitit_job_saves_on_submitits_signal_and_submitit_requeues_it(
    cluster, tmp_path: Path, capsys, uninterrupted
):
    """hydra/launcher=slurm: submitit's SIGUSR2 (its --signal) in rank 1's backward; Preemption saves at the step's
    end and hands the requeue to submitit's own handler (its resubmission pickle, its timeout count)."""
    sweep = tmp_path / "sweep"
    job_dir = "${hydra:runtime.output_dir}"  # one checkpoint directory per job of the sweep
    cmd = [
        sys.executable, str(RECIPE), "--multirun", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
        "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.tasks_per_node=2",
        "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", *TINY, *PREEMPT,
        "callbacks=[activation_checkpointing,model_checkpoint]", f"callbacks.model_checkpoint.dirpath={job_dir}/checkpoints",
        f"++trainer.default_root_dir={job_dir}", "ckpt_path=last",
        _fault("usr2", at="backward", step=7, ranks="[1]", signal="SIGUSR2"),
    ]  # fmt: skip
    start = time.monotonic()
    with open(tmp_path / "multirun.out", "w") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(cluster), stdout=log, stderr=subprocess.STDOUT)
        deadline = start + 300
        while proc.poll() is None:  # release the requeued job from SLURM's two-minute hold, as above
            queue = subprocess.run(["squeue", "-h", "-t", "PD", "-o", "%i %r"], capture_output=True, text=True,
                                   env=cluster.env).stdout.split("\n")  # fmt: skip
            for job_id, reason in (line.split() for line in queue if line.strip()):
                if reason == "BeginTime":
                    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=cluster.env)
            if time.monotonic() > deadline:
                proc.kill()
                jobs = subprocess.run(["scontrol", "show", "job"], capture_output=True, text=True, env=cluster.env)
                logs = "\n".join(p.read_text()[-3000:] for p in sorted((sweep / ".submitit").glob("*/*_log.*")))
                raise AssertionError(f"the sweep did not end in 300 s; the jobs:\n{jobs.stdout}\n{logs}\n"
                                     f"{cluster.log_tail(30)}")  # fmt: skip
            time.sleep(0.2)
    with capsys.disabled():
        print(f"\nsubmitit job preempted once: {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, (tmp_path / "multirun.out").read_text()[-5000:]
    (err,) = (sweep / ".submitit").glob("*/*_0_log.err")  # rank 0; --open-mode=append: both starts
    text = err.read_text()
    assert SAVING.findall(text) == [("rank 1: SIGUSR2", "8")], text[-4000:]
    assert "Preemption: submitit launched this job; its handler requeues it" in text
    out = err.with_name(err.name.replace(".err", ".out")).read_text()
    # submitit's own handler ran, called by Preemption after the save, and requeued the job (its `scontrol requeue`
    # either returned, or was ended by the SIGTERM of the requeue it had made: a race, either way the job restarts).
    assert "Caught signal SIGUSR2" in out, out[-3000:]
    returned = f"Requeued job {err.parent.name}" in out
    ended = "SLURM ended submitit's `scontrol requeue` as it took the requeue" in text
    assert returned != ended, out[-3000:] + text[-3000:]
    restored = re.findall(r"Restored all states from the checkpoint at (\S+)", text)
    assert restored == [str(sweep / "0" / "hpc_ckpt_1.ckpt")], text[-4000:]
    saved = torch.load(sweep / "0" / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == STEPS
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in uninterrupted.items())
