"""The locked test environment (issue #21): the lock, pyproject's ranges and the README's commands agree.

``requirements/test.lock`` pins every distribution the README's test command installs;
these checks keep it honest when either side changes: each direct dependency is pinned at
a version its declared range admits, the two Quickstart commands install with the lock,
and ``python -m ckpt_tools.lock`` writes what it says (torch without its local build label).
"""

from __future__ import annotations

import re
import tomllib

from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ckpt_tools.fresh_env import floors
from ckpt_tools.latest_deps import differences, locked
from ckpt_tools.lock import LOCK, lock_text
from test_docs import quickstart

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins() -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in locked().items()}


def test_every_direct_dependency_is_locked_inside_its_declared_range() -> None:
    pins = _pins()
    outside = {}
    for text in [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["test"]]:
        requirement = Requirement(text)
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None or not requirement.specifier.contains(pin):
            outside[text] = pin
    assert not outside, f"not locked, or locked outside pyproject's range: {outside}"


def test_every_lock_line_is_an_exact_pin() -> None:
    lines = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.!]+", line) for line in lines), lines
    assert _pins()["torch"] == "2.13.0"  # any build of the release: no local label such as +cpu


def test_both_quickstart_commands_install_with_the_lock() -> None:
    commands = [line for line in quickstart().splitlines() if line.strip()]
    assert len(commands) == 2
    assert all("pip install -q -c requirements/test.lock -e " in command for command in commands), commands


def test_lock_text_sorts_pins_and_drops_the_local_label() -> None:
    text = lock_text({"torch": "2.13.0+cpu", "Jinja2": "3.1.6", "aiohttp": "3.14.5"})
    assert [line for line in text.splitlines() if not line.startswith("#")] == [
        "aiohttp==3.14.5", "Jinja2==3.1.6", "torch==2.13.0"]
    assert "python -m ckpt_tools.lock" in text


def test_floors_are_the_declared_lower_bounds() -> None:
    lowest = floors("test")
    assert lowest["lightning"] == "2.6" and lowest["hydra-core"] == "1.3.2" and lowest["torch"] == "2.11"
    assert lowest["jsonargparse"] == "4.39"  # the extra [signatures] does not hide the name


def test_differences_name_each_version_that_moved() -> None:
    rows = differences({"torch": "2.13.0+cpu", "lightning": "2.7.0", "newpkg": "1.0"},
                       {"torch": "2.13.0", "lightning": "2.6.6"})
    assert [row.split()[:4] for row in rows] == [["lightning", "2.6.6", "->", "2.7.0"],
                                                 ["newpkg", "(not", "in", "lock)"]]
