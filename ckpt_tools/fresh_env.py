"""A throw-away virtual environment with the project installed: what ``lock`` and ``latest_deps`` build on.

Both need the same thing, a new venv where pip resolves the project's own ranges
(``pyproject.toml``) with nothing else installed, so the versions it picks are the
ones a new user would get on that day. torch comes first and is held to
``TORCH`` (our machines have it as a local CPU wheel; an unpinned torch pulls
gigabytes of CUDA packages), as the README's two commands do, and stays there
while the rest resolves.
"""

from __future__ import annotations

import subprocess
import tempfile
import tomllib
import venv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packaging.requirements import Requirement  # packaging: Lightning's own dependency
from packaging.utils import canonicalize_name

__all__ = ["ROOT", "TORCH", "Env", "floors", "fresh_env"]

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the README's first install; keep the two in step


class Env:
    """A venv at ``path``: run its python and pip, read what it has installed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.python = str(path / "bin" / "python")

    def pip(self, *args: str) -> None:
        cmd = [self.python, "-m", "pip", "install", "-q", *args]
        print("+", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)

    def versions(self) -> dict[str, str]:
        """name -> version of every distribution installed, the project and pip's own tools aside."""
        out = subprocess.run([self.python, "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
                             check=True, capture_output=True, text=True).stdout
        pairs = (line.split("==", 1) for line in out.splitlines() if "==" in line)
        return {name: version for name, version in pairs if canonicalize_name(name) not in _PIP_TOOLS}


_PIP_TOOLS = {"pip", "setuptools", "wheel"}


@contextmanager
def fresh_env(extras: str = "test", *pip_args: str, torch: str = TORCH, at: Path | None = None) -> Iterator[Env]:
    """A new venv, ``torch`` installed first, then ``-e .[extras]`` with ``pip_args`` (``-c FILE``, ``-U``).

    ``at``: build it there and keep it (a venv already there is used as it is: its torch and
    the project are installed again, which pip skips when nothing changed); else a temporary one.
    """
    with tempfile.TemporaryDirectory(prefix="ckpt-env-") as tmp:
        path = at or Path(tmp) / "venv"
        if not (path / "bin" / "python").exists():
            venv.create(path, with_pip=True)
        env = Env(path)
        env.pip(torch)
        # Held there while the rest resolves: torchvision (timm's, in the test extra) pins one torch release
        # exactly, and pip would replace the torch installed by the newest torchvision's (0.29 pins 2.14: a CUDA
        # build of several GB) rather than take the torchvision of the torch installed.
        held = Path(tmp) / "torch.txt"
        held.write_text(f"{torch}\n")
        env.pip(*pip_args, "-c", str(held), "-e", f".[{extras}]" if extras else ".")
        yield env


def floors(extras: str = "test") -> dict[str, str]:
    """The lowest version each direct dependency admits (``>=`` floors), from ``pyproject.toml``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"].get(extras, [])]
    lowest: dict[str, str] = {}
    for text in requirements:
        req = Requirement(text)
        for spec in req.specifier:
            if spec.operator in (">=", "=="):
                lowest[req.name] = spec.version
    return lowest
