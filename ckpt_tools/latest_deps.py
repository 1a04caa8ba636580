"""Run the suite against the newest releases our ranges allow (or the lowest), apart from CI's locked run.

    python -m ckpt_tools.latest_deps                 # newest of everything pyproject admits, then the README's pytest
    python -m ckpt_tools.latest_deps --lowest        # every direct dependency at its declared floor
    python -m ckpt_tools.latest_deps -- -x tests/test_hf.py   # arguments after -- go to pytest

CI installs the lock (``requirements/test.lock``), so a release of a dependency
cannot turn it red; this is where such a release shows up first, on purpose. It
builds a throw-away venv (torch held to the README's build), prints every version
that differs from the lock, runs the suite there, and exits with pytest's code.
Green: ``python -m ckpt_tools.lock`` may take those versions. ``--lowest`` checks
that the floors ``pyproject.toml`` declares are ones that really pass.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from ckpt_tools.fresh_env import ROOT, floors, fresh_env
from ckpt_tools.lock import LOCK


def locked() -> dict[str, str]:
    pairs = (line.split("==", 1) for line in LOCK.read_text().splitlines() if "==" in line and line[0] != "#")
    return {name.lower(): version for name, version in pairs}


def differences(versions: dict[str, str], lock: dict[str, str]) -> list[str]:
    """One line per distribution whose version is not the lock's (torch's local label aside)."""
    rows = []
    for name, version in sorted(versions.items(), key=lambda kv: kv[0].lower()):
        was = lock.get(name.lower())
        if was != version.split("+")[0]:
            rows.append(f"  {name:<28} {was or '(not in lock)':<16} -> {version}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lowest", action="store_true", help="install each direct dependency at its floor")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --); default: the README's "
                        "-q -n 2 --dist loadfile")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ckpt-floors-") as tmp:
        pip_args: list[str] = []
        if args.lowest:
            constraints = Path(tmp) / "floors.txt"
            constraints.write_text("".join(f"{name}=={v}\n" for name, v in floors("test").items() if name != "torch"))
            pip_args = ["-c", str(constraints)]
        with fresh_env("test", *pip_args) as env:
            versions = env.versions()
            label = "lowest" if args.lowest else "newest"
            rows = differences(versions, locked())
            print(f"{label} releases: {len(versions)} distributions, {len(rows)} differ from {LOCK.name}:")
            print("\n".join(rows) or "  (none)", flush=True)
            cmd = [env.python, "-m", "pytest", *(args.pytest_args or ["-q", "-n", "2", "--dist", "loadfile"])]
            print("+", " ".join(cmd), flush=True)
            return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
