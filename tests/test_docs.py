"""Every shell and Python block of README.md and docs/*.md runs, as a reader would run it (issue #32).

The blocks are read out of the pages, never copied here. What happens to a block is said in the page,
in an HTML comment on the line before it:

- none: it runs here. A ``python`` block as a script of its own, from the repository root; a
  ``bash``/``sh`` block line by line, each line as typed, with the venv's ``bin`` first on ``PATH``,
  in a scratch folder that links the repository's ``recipes/`` and ``examples/`` (so runs write
  nothing into the checkout);
- ``<!-- composed: why -->``: lines of ``python recipes/train.py <overrides>`` that train for minutes or
  need GPUs: each line's overrides are composed with the recipe's config and checked by
  ``check_app_config`` (a renamed preset or key fails here), nothing is trained;
- ``<!-- run by <test>: how -->``: that test reads this very block from the docs and runs it
  (checked below: the test's source names the page);
- ``<!-- not run: why -->``: it cannot run here (a GPU, a SLURM cluster, a registry download, a run of
  many minutes); the reason is in the page for the reader too.

A block with no comment that is not run fails the test, so a new example cannot go unchecked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import warm_python

from ckpt_plugin.lightning.app import check_app_config
from conftest import ROOT, compose_train

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- (?P<mark>.*?) -->\n)?^```(?P<lang>bash|sh|python)\n(?P<body>.*?)^```$", re.S | re.M)
VENV_BIN = Path(sys.executable).parent


class Block(NamedTuple):
    page: str
    lang: str
    mark: str  # "" (runs here), "composed: ...", "run by ...", "not run: ..."
    body: str


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        for m in BLOCK.finditer(page.read_text(encoding="utf-8")):
            found.append(Block(page.relative_to(ROOT).as_posix(), m["lang"], m["mark"] or "", m["body"]))
    return found


def commands(body: str) -> list[str]:
    """A shell block's commands: one a line, a trailing backslash joining the next; comments and blanks dropped."""
    joined = body.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def quickstart() -> str:
    """The README's first block under "## Quickstart", as .ci/run reads it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.search(r"^## Quickstart\n.*?```bash\n(.*?)```", readme, re.S | re.M).group(1)


ALL = blocks()
RUN = [b for b in ALL if not b.mark]
SHELL_LINES = sorted({line for b in RUN if b.lang != "python" for line in commands(b.body)})
PYTHON = [b for b in RUN if b.lang == "python"]


def test_every_block_is_run_or_says_why_not() -> None:
    assert len(ALL) > 20  # the pattern still finds the pages' blocks
    marks = {b.mark.split(":")[0].split(" by ")[0] for b in ALL if b.mark}
    assert marks <= {"composed", "run", "not run"}, marks
    for b in ALL:
        if b.mark.startswith("not run"):
            assert len(b.mark) > len("not run: ") + 10, f"{b.page}: say why the block is not run: {b.mark!r}"


def test_the_quickstart_is_two_commands_and_every_copy_of_it_equals_the_readme() -> None:
    lines = commands(quickstart())
    assert len(lines) == 2 and all("-c requirements/test.lock" in line for line in lines), lines
    for b in ALL:
        if b.mark.startswith("run by .ci/run"):
            assert b.body == quickstart(), f"{b.page}: differs from the README's Quickstart, which .ci/run runs"


def test_blocks_run_by_another_test_are_read_from_the_docs_there() -> None:
    for b in ALL:
        if b.mark.startswith("run by tests/"):
            test_file = ROOT / b.mark.removeprefix("run by ").split(":")[0]
            source = test_file.read_text(encoding="utf-8")
            assert "from test_docs import" in source, f"{test_file.name} does not read its block from {b.page}"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark.startswith("composed")], ids=lambda b: b.page)
def test_composed_lines_are_valid_overrides_of_the_recipe(block: Block) -> None:
    for line in commands(block.body):
        argv = shlex.split(line, comments=True)
        assert argv[:2] == ["python", "recipes/train.py"], line
        overrides = [a for a in argv[2:] if a != "--multirun"]
        check_app_config(compose_train(*overrides))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where the docs' relative paths resolve and runs may write: recipes/ and examples/ linked."""
    where = tmp_path_factory.mktemp("docs")
    for name in ("recipes", "examples"):
        (where / name).symlink_to(ROOT / name)
    return where


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def ran(scratch: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every unmarked block's commands and Python blocks, two at a time (most of each is imports).

    ``python <script> ...`` and Python blocks run as forks of a process that imported torch, Lightning
    and Hydra once (``warm_python``, as the other tests run scripts: ~3.5 s of imports saved each);
    any other command (``ckpt-inspect``) through ``bash`` as typed.
    """

    def shell(line: str) -> subprocess.CompletedProcess:
        argv = shlex.split(line, comments=True)
        if argv[0] == "python":
            return warm_python.run(argv[1:], cwd=scratch, env=_env(), timeout=300)
        return subprocess.run(["bash", "-c", line], cwd=scratch, env=_env(), capture_output=True, text=True, timeout=300)

    def python(code: str) -> subprocess.CompletedProcess:
        script = scratch / f"block_{abs(hash(code))}.py"
        script.write_text(code, encoding="utf-8")
        return warm_python.run([str(script)], cwd=ROOT, env=_env(), timeout=300)

    jobs = {line: (shell, line) for line in SHELL_LINES} | {b.body: (python, b.body) for b in PYTHON}
    with ThreadPoolExecutor(2) as pool:
        futures = {key: pool.submit(fn, arg) for key, (fn, arg) in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("line", SHELL_LINES)
def test_shell_line_runs(ran: dict, line: str) -> None:
    proc = ran[line]
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: f"{b.page}:{b.body.splitlines()[0][:40]}")
def test_python_block_runs(ran: dict, block: Block) -> None:
    proc = ran[block.body]
    assert proc.returncode == 0, f"{block.page}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for shown in re.findall(r"print\(.*\)\s+# (\[.*?\])", block.body):  # a list a comment shows is what it prints
        if "..." not in shown:
            assert shown in proc.stdout, (shown, proc.stdout[-2000:])
