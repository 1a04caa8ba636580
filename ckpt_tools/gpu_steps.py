"""The GPU check's steps: each a process of its own, with its own time limit, within the check's deadline.

    run = Check(out, work, env, deadline, limits, root)
    step = run.run("bench", [sys.executable, "-m", "ckpt_tools.bench", ...], "bench.log")
    step.status                                   # ok, failed (exit N), timed out after N s, not run: ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Step:
    """One step's process: what ran, how it ended, where its output is."""

    name: str
    command: list[str]
    log: str
    limit_s: float
    returncode: int | None = None  # None: not started (no time was left)
    seconds: float = 0.0
    timed_out: bool = False
    note: str = ""

    @property
    def status(self) -> str:
        if self.returncode is None:
            return f"not run: {self.note}" if self.note else "not run"
        if self.timed_out:
            return f"timed out after {self.limit_s:.0f} s"
        return "ok" if self.returncode == 0 else f"failed (exit {self.returncode})"


@dataclass
class Check:
    """The run: its folders, its deadline and the steps so far."""

    out: Path
    work: Path
    env: dict[str, str]
    deadline: float  # time.monotonic() by which the last step must end
    limits: dict[str, float]  # step name -> its own limit in seconds
    root: Path  # where each step runs
    steps: list[Step] = field(default_factory=list)

    def run(self, name: str, command: list[str], log: str, env: dict[str, str] | None = None) -> Step:
        """Run ``command`` in the repository root, output appended to ``out/log``, within its limit; ``env``:
        variables set for it alone."""
        left = self.deadline - time.monotonic()
        step = Step(name, command, log, max(0.0, min(self.limits[name], left)))
        self.steps.append(step)
        if step.limit_s < 5:
            step.note = "the check's deadline came first"
            return step
        with open(self.out / log, "a") as f:
            f.write(f"\n===== {name}: {' '.join(command)} (limit {step.limit_s:.0f} s)\n")
            f.flush()
            start = time.monotonic()
            # A session of its own, so that a step past its limit is ended with every process it started.
            proc = subprocess.Popen(command, cwd=self.root, env=self.env | (env or {}), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                step.returncode = proc.wait(timeout=step.limit_s)
            except subprocess.TimeoutExpired:
                step.timed_out = True
                _end(proc)
                step.returncode = proc.returncode
            step.seconds = time.monotonic() - start
            f.write(f"===== {name}: {step.status}, {step.seconds:.1f} s\n")
        return step


def _end(proc: subprocess.Popen) -> None:
    """SIGINT to the step's process group, then SIGTERM, then SIGKILL, each if it is still there.

    SIGINT first: pytest stops as on Ctrl-C and still writes its summary and its junit XML, so a
    test step cut by its limit reports the tests it ran.
    """
    for sig, wait in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


__all__ = ["Check", "Step"]
