"""Reliability as a figure: run a SLURM requeue test N times, each in a fresh pytest and a fresh cluster.

    python tests/slurm_loop.py                       # 20 runs of the requeue-signal (mid-save SIGKILL) test
    python tests/slurm_loop.py -n 5 -k "preemption or three or save"

Prints one line per run (pass/FAIL and seconds) and then ``passes/N``; exits 1 if any run
failed. Not a test: the default suite runs each test once, and every wait in it is bounded
(tests/test_slurm.py), so a hang there is a failure with a message, never a stuck CI. Needs
what tests/test_slurm.py needs: root and SLURM installed (or CKPT_INSTALL_SLURM=1).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = "test_requeue_signal_mid_save_then_sigkill_leaves_the_previous_checkpoint"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20, help="how many runs (default 20)")
    parser.add_argument("-k", default=DEFAULT, help=f"pytest -k expression within test_slurm.py (default {DEFAULT})")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take before it counts as hung")
    args = parser.parse_args(argv)

    passes, seconds = 0, []
    for run in range(1, args.n + 1):
        cmd = [sys.executable, "-m", "pytest", str(HERE / "test_slurm.py"), "-k", args.k, "-q", "-x",
               "-p", "no:cacheprovider", "-rs"]  # fmt: skip
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, timeout=args.timeout)
            summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "(no output)"
            ok = proc.returncode == 0 and "passed" in summary and "skipped" not in summary
        except subprocess.TimeoutExpired:
            proc, summary, ok = None, f"hung: no result in {args.timeout:.0f} s", False
        took = time.monotonic() - start
        seconds.append(took)
        passes += ok
        print(f"run {run:2d}/{args.n}: {'pass' if ok else 'FAIL'}  {took:6.1f} s  {summary}", flush=True)
        if not ok and proc is not None:
            print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    print(f"{passes}/{args.n} passed; seconds per run: min {min(seconds):.1f}, "
          f"median {sorted(seconds)[len(seconds) // 2]:.1f}, max {max(seconds):.1f}")  # fmt: skip
    return 0 if passes == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
