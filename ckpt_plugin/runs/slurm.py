"""What a process can learn from SLURM about its own job, and the one thing it asks of it: a requeue.

Facts behind the choices in ``preemption.py``, seen with SLURM 22.05 on a local cluster
(``tests/slurm_cluster.py``) when a job's tasks receive SIGTERM:

- ``scancel``: ``scontrol show job`` says ``JobState=COMPLETING``, ``PreemptTime=None``;
- ``scontrol requeue``: ``COMPLETING`` and ``Restarts`` one higher (already requeued);
- preemption with ``PreemptMode=REQUEUE``: ``RUNNING`` with a ``PreemptTime``. SLURM requeues
  the job only if it is still running when the grace time ends; a job whose tasks exit
  before that ends FAILED and stays so.
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["being_preempted", "ended_by_requeue", "job_id", "launched_by_submitit", "requeue"]


def job_id() -> str | None:
    """This job's id as ``scontrol`` takes it (``<array job>_<task>`` in an array), or None outside SLURM."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return os.environ.get("SLURM_JOB_ID")


def launched_by_submitit() -> bool:
    """Whether submitit started this process (its sbatch script exports ``SUBMITIT_EXECUTOR=slurm``)."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def _job_state(job: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (empty if scontrol cannot say): JobState, PreemptTime, ..."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(pair.split("=", 1) for pair in out.split() if "=" in pair)


def being_preempted(job: str) -> tuple[bool, str]:
    """Whether SLURM is preempting ``job`` now, and its JobState (for a message)."""
    state = _job_state(job)
    return state.get("JobState") == "RUNNING" and state.get("PreemptTime", "None") != "None", state.get("JobState", "?")


def ended_by_requeue(returncode: int) -> bool:
    """Whether ``scontrol requeue`` exited by SLURM's SIGTERM, which it sends once it has taken the requeue.

    ``scontrol`` runs inside the job it requeues, so SLURM ends it with the job's other processes: the SIGTERM
    of the requeue can reach it before it has returned (seen in CI under load: submitit's ``check_call`` raised
    ``CalledProcessError`` with -15, and the job started again). Any other failure is a refusal.
    """
    return returncode == -signal.SIGTERM


def requeue(job: str) -> str | None:
    """``scontrol requeue <job>``: None once SLURM took it, else why not."""
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if proc.returncode != 0 and not ended_by_requeue(proc.returncode):
        return f"exited {proc.returncode}: {proc.stderr.strip()} (is the job submitted with --requeue?)"
    return None
