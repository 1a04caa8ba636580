"""A real single-node SLURM for the suite: munged, slurmctld and slurmd on this host.

    with running_cluster() as cluster:                 # well under a second from nothing to an idle node
        subprocess.run(["sbatch", "--wait", ...], env=cluster.env)

Everything lives in one temporary directory (config, state, logs, the munge key and
socket) on ports picked free, so nothing under /etc changes and a SLURM already on the
machine is left alone. The daemons run as root, as slurmd must to start job steps; the
job runs as whoever submits it. `unavailable()` says why the cluster cannot run here
(the tests skip with that reason); the Debian packages are installed when missing if
running as root with CI=true or CKPT_INSTALL_SLURM=1. Seen working with SLURM 22.05
and munge 0.5.15 on Debian 12, no systemd, no cgroups.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "job_info", "running_cluster", "unavailable"]

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
DAEMONS = ["munged", "slurmctld", "slurmd"]
CLIENTS = ["sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel"]
SBIN = "/usr/sbin"  # the daemons live here, which is not on every user's PATH

SLURM_CONF = """\
ClusterName=ckpt-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# batch_sched_delay=0: a submitted or released batch job is scheduled at slurmctld's next pass (once a second),
# not up to 3 s later. slurmctld reads it in its first scheduling pass (_schedule), which the default delay
# puts 3 s after start-up; bf_interval=1 runs the backfill scheduler, which starts jobs too, every second
# from start-up, so the first job does not wait for that pass.
SchedulerParameters=batch_sched_delay=0,bf_interval=1
EnforcePartLimits=ALL
# MinJobAge <= 4 keeps `sbatch --wait` polling every 2 s (it backs off to MinJobAge/2 otherwise);
# slurmctld purges old records once a minute, so `scontrol show job` still sees a finished job.
MinJobAge=4
# From SIGTERM to SIGKILL when a job is cancelled or requeued; only a task still running waits it out (the
# test of a save stalled until SIGKILL). Not lower: slurmd waits max(KillWait, 5 s) itself before it kills
# what is left of a job (_rpc_terminate_job), and KillWait=2 took that test 7 s to the SIGKILL, not 5 s.
KillWait=5
MailProg=/bin/true
ReturnToService=2
# config_overrides: trust the node line below, not the hardware (CPUs may be raised to 2 for two ranks).
SlurmdParameters=config_overrides
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# Preemption as clusters configure it: a job in `urgent` (higher PriorityTier) requeues the jobs in `debug`
# it needs the CPUs of, after SIGTERM and GraceTime seconds (then SIGKILL).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=5
PartitionName=urgent Nodes={host} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


@dataclass(frozen=True)
class Cluster:
    root: Path  # config, state, logs and the munge socket
    env: dict[str, str]  # os.environ plus SLURM_CONF: pass it to sbatch, scontrol, ...
    host: str  # the one node's name
    cpus: int
    ctld_port: int  # where slurmctld listens, on 127.0.0.1

    def log_tail(self, lines: int = 20) -> str:
        """The end of both daemons' logs, for an error message."""
        parts = []
        for name in ("slurmctld", "slurmd"):
            path = self.root / "log" / f"{name}.log"
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
            parts.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(parts)


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN)


def _missing() -> list[str]:
    return [name for name in DAEMONS + CLIENTS if _which(name) is None]


def unavailable() -> str | None:
    """Why a local SLURM cannot run here, or None once it can (installing it if allowed)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "a local SLURM needs Linux"
    if os.geteuid() != 0:
        return "not root: slurmd must run as root to start job steps"
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        return f"the host name {host!r} does not resolve (add it to /etc/hosts); slurmd names its node by it"
    missing = _missing()
    if not missing:
        return None
    if os.environ.get("CI") != "true" and os.environ.get("CKPT_INSTALL_SLURM") != "1":
        return f"SLURM is not installed ({', '.join(missing)} missing); set CKPT_INSTALL_SLURM=1 to apt-get install it"
    if shutil.which("apt-get") is None:
        return f"cannot install SLURM: no apt-get ({', '.join(missing)} missing)"
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    for cmd in (["apt-get", "update", "-qq"], install):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            # Installing was allowed and possible: a failure is an error, not a reason to skip.
            output = f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}")
    if missing := _missing():
        raise RuntimeError(f"apt-get installed {PACKAGES} but {missing} are still not found")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory() -> int:
    """The node's memory in MiB as slurmd measures it (a node line asking for more is drained)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"RealMemory=(\d+)", out).group(1))


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: {' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def _start_munged(root: Path, env: dict[str, str]) -> None:
    munge = root / "munge"
    munge.mkdir(mode=0o755)  # munged refuses a socket whose directory others cannot search
    key = munge / "munge.key"
    key.write_bytes(os.urandom(128))  # the size `mungekey` makes
    key.chmod(0o400)
    _run(
        [_which("munged"), f"--socket={munge}/munge.socket", f"--key-file={key}", f"--log-file={munge}/munged.log",
         f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed"],
        env, "starting munged",
    )  # fmt: skip


def _wait_listening(cluster: Cluster, timeout: float = 30.0) -> None:
    """Until slurmctld accepts connections: slurmd, sinfo and the rest try again only a second after a refusal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # An empty connection: slurmctld logs "Zero Bytes were transmitted or received", once.
            socket.create_connection(("127.0.0.1", cluster.ctld_port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.01)
    raise RuntimeError(f"slurmctld not listening on {cluster.ctld_port} after {timeout:.0f} s:\n{cluster.log_tail()}")


def _wait_idle(cluster: Cluster, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=cluster.env)
        state = proc.stdout.strip()
        if state and set(state.split()) == {"idle"}:  # one line per partition the node is in
            return
        time.sleep(0.05)
    raise RuntimeError(f"the node did not become idle in {timeout:.0f} s (last state {state!r}):\n{cluster.log_tail()}")


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A daemon that exited but was never reaped (no init in some containers) is a zombie: gone for us.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return True


def _stop(cluster: Cluster) -> None:
    """Cancel every job, shut the SLURM daemons down, stop munged; each by the pid it wrote."""
    env, root = cluster.env, cluster.root
    if (root / "slurmctld.pid").exists():
        subprocess.run(["scancel", "--full", f"--user={os.geteuid()}"], capture_output=True, env=env, timeout=30)
        deadline = time.monotonic() + 15  # KillWait=5: steps get SIGTERM, then SIGKILL 5 s later
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%T"], capture_output=True, text=True, env=env)
            if queue.returncode != 0 or not set(queue.stdout.split()) & {"RUNNING", "COMPLETING", "PENDING"}:
                break
            time.sleep(0.3)
        subprocess.run(["scontrol", "shutdown"], capture_output=True, env=env, timeout=30)
    pids = {name: _pid(root / f"{name}.pid") for name in ("slurmctld", "slurmd")}
    pids["munged"] = _pid(root / "munge" / "munged.pid")
    deadline = time.monotonic() + 15
    for name in ("slurmctld", "slurmd", "munged"):
        pid = pids[name]
        if pid is None:
            continue
        if name == "munged":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, 9)


@contextlib.contextmanager
def running_cluster() -> Iterator[Cluster]:
    """munged, slurmctld and slurmd in a fresh temporary directory, idle and ready; all stopped on exit."""
    if reason := unavailable():
        raise RuntimeError(reason)
    # Not under pytest's tmp_path: munged checks that every directory above its socket is searchable.
    root = Path(tempfile.mkdtemp(prefix="ckpt-slurm-"))
    root.chmod(0o755)
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]  # slurmctld and slurmd find their lines by this name
    cpus = max(2, os.cpu_count() or 1)  # two ranks need two CPUs even on a one-core runner
    conf = root / "slurm.conf"
    ctld_port = _free_port()
    conf.write_text(SLURM_CONF.format(
        host=host, root=root, cpus=cpus, memory=_real_memory(), ctld_port=ctld_port, slurmd_port=_free_port(),
    ))  # fmt: skip
    env = os.environ | {"SLURM_CONF": str(conf), "PATH": f"{os.environ.get('PATH', '')}:{SBIN}"}
    cluster = Cluster(root=root, env=env, host=host, cpus=cpus, ctld_port=ctld_port)
    try:
        _start_munged(root, env)
        _run([_which("slurmctld"), "-i", "-f", str(conf)], env, "starting slurmctld")  # -i: ignore old state
        _wait_listening(cluster)  # else slurmd may register a second later
        _run([_which("slurmd"), "-f", str(conf)], env, "starting slurmd")
        _wait_idle(cluster)
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


def job_info(cluster: Cluster, job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, RunTime, ...): there is no sacct without accounting.

    Only until slurmctld purges the record (MinJobAge, checked once a minute).
    """
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=cluster.env)
    if out.returncode != 0:
        raise RuntimeError(f"scontrol show job {job_id}: {out.stderr.strip()}")
    # One line of Key=Value pairs; values have no spaces except Command=/WorkDir= paths, which we don't read.
    return dict(pair.split("=", 1) for pair in out.stdout.split() if "=" in pair)
