"""Run the suite against the newest releases our ranges allow (or the lowest), apart from CI's locked run.

    python -m ckpt_tools.latest_deps                 # newest of everything pyproject admits, then the README's pytest
    python -m ckpt_tools.latest_deps --lowest        # every direct dependency at its declared floor
    python -m ckpt_tools.latest_deps -- -x tests/test_hf.py   # arguments after -- go to pytest
    python -m ckpt_tools.latest_deps --torch 2.11.0  # the lock's versions, on another torch release
    python -m ckpt_tools.latest_deps --torch 2.15.0 --venv /tmp/t215   # keep the venv, to run again
    python -m ckpt_tools.latest_deps --torch floor --core    # the core subset on pyproject's torch floor (.ci/run)

CI installs the lock (``requirements/test.lock``), so a release of a dependency
cannot turn it red; this is where such a release shows up first, on purpose. It
builds a throw-away venv (torch held to the README's build), prints every version
that differs from the lock, runs the suite there, and exits with pytest's code.
Green: ``python -m ckpt_tools.lock`` may take those versions. ``--lowest`` checks
that the floors ``pyproject.toml`` declares are ones that really pass.

``--torch VERSION`` is the supported-torch check (README, "The torch you have"):
that torch release first, then everything else at the lock's versions, so the
suite meets only torch's differences. A release other than the README's CPU
build is the registry's, a CUDA build of several GB on x86-64; it runs on the CPU here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from ckpt_tools.fresh_env import ROOT, TORCH, floors, fresh_env
from ckpt_tools.gpu_check import CORE_TESTS
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
    parser.add_argument("--torch", metavar="VERSION", help="this torch release (floor: pyproject's lowest), the "
                        "lock's versions of the rest")
    parser.add_argument("--venv", type=Path, help="build the venv here and keep it (reused if there)")
    parser.add_argument("--core", action="store_true", help="run the core subset of the suite (the GPU check's: "
                        "engine, policies, segments, offload, scan, measuring, auto, Hydra), not all of it")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --); default: the README's "
                        "-q -n 2 --dist loadfile")
    args = parser.parse_args(argv)
    if args.torch == "floor":  # pip's == pads the release: 2.11 is 2.11.0
        args.torch = floors("test")["torch"]
    with tempfile.TemporaryDirectory(prefix="ckpt-floors-") as tmp:
        pip_args: list[str] = []
        constraints = Path(tmp) / "constraints.txt"
        if args.lowest:
            constraints.write_text("".join(f"{name}=={v}\n" for name, v in floors("test").items() if name != "torch"))
            pip_args = ["-c", str(constraints)]
        elif args.torch:  # the lock, torch held to the release asked for (the project's range admits newer ones)
            # torchvision's release follows torch's (0.28.0 pins torch==2.13.0): pip takes the one of that torch
            pins = {name: v for name, v in locked().items() if name not in ("torch", "torchvision")}
            pins["torch"] = args.torch
            constraints.write_text("".join(f"{name}=={v}\n" for name, v in pins.items()))
            pip_args = ["-c", str(constraints)]
        torch = f"torch=={args.torch}" if args.torch else TORCH
        with fresh_env("test", *pip_args, torch=torch, at=args.venv) as env:
            versions = env.versions()
            label = f"torch {args.torch}, locked" if args.torch else "lowest" if args.lowest else "newest"
            rows = differences(versions, locked())
            print(f"{label} releases: {len(versions)} distributions, {len(rows)} differ from {LOCK.name}:")
            print("\n".join(rows) or "  (none)", flush=True)
            chosen = list(CORE_TESTS) if args.core else []
            cmd = [env.python, "-m", "pytest", *(args.pytest_args or ["-q", "-n", "2", "--dist", "loadfile"]), *chosen]
            print("+", " ".join(cmd), flush=True)
            return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
