"""The docs' examples for plain PyTorch, Fabric and Hugging Face: each runs as a user runs it, and
the docs show the very file that ran (``examples/``, a block of docs/torch.md, fabric.md,
huggingface.md, lightning-cli.md). LightningCLI's has its own test (``tests/test_lightning_cli.py``);
its files are checked against the docs here too."""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import warm_python
from test_docs import PAGES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RUN = ("plain_pytorch.py", "fabric.py", "huggingface.py")


def _docs_blocks() -> list[str]:
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    return [m.group(1) for m in re.finditer(r"^```(?:python|yaml)\n(.*?)^```", text, re.S | re.M)]


@pytest.mark.parametrize("name", [*RUN, "lightning_cli.py", "lightning_cli.yaml"])
def test_docs_show_the_example_file(name: str) -> None:
    assert (EXAMPLES / name).read_text(encoding="utf-8") in _docs_blocks(), f"no docs block equal to examples/{name}"


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every example, as ``python examples/<name>`` from a directory of its own (run side by side: imports dominate)."""

    dirs = {name: tmp_path_factory.mktemp(name.removesuffix(".py")) for name in RUN}

    def one(name: str) -> tuple[str, subprocess.CompletedProcess]:
        env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
        proc = warm_python.run([str(EXAMPLES / name)], env=env, cwd=dirs[name], timeout=300)
        return name, (proc, dirs[name])

    with ThreadPoolExecutor(len(RUN)) as pool:
        return dict(pool.map(one, RUN))


BLOCKS = [f"blocks.{i}" for i in range(6)]
WRAPPED = {"plain_pytorch.py": BLOCKS, "fabric.py": BLOCKS, "huggingface.py": ["transformer.h.0", "transformer.h.1"]}
STEPS = {"plain_pytorch.py": 5, "fabric.py": 5, "huggingface.py": 3}


@pytest.mark.parametrize("name", RUN)
def test_example_trains_what_it_says_and_writes_nothing(ran: dict, name: str) -> None:
    proc, cwd = ran[name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert f"checkpointed: {WRAPPED[name]}" in lines
    losses = [float(line.split("loss ")[1]) for line in lines if line.startswith("step ")]
    assert len(losses) == STEPS[name] and all(loss == loss for loss in losses)  # every step ran, no NaN
    assert list(cwd.iterdir()) == []


def test_hugging_face_example_reports_the_bytes_it_saves(ran: dict) -> None:
    proc, _ = ran["huggingface.py"]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("saved for backward:"))
    before, after = map(int, re.findall(r"\d+", line))
    assert after < before
    assert "is training, so it runs with use_cache=False" in proc.stderr  # the one warning, once
    assert proc.stderr.count("ckpt_plugin: GPT2LMHeadModel") == 1
