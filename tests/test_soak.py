"""ckpt-soak: a short run of every mode leaks nothing, and a leak is seen.

Counts of tensors, storage bytes and hooks are exact and asserted; timings and RSS never are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_plugin import soak
from ckpt_plugin.soak import DEFAULT_MODES, LiveStorages, Snapshot, main

EXACT = Snapshot.EXACT
WRAPPED = {"none": 0, "full": 4, "every_n_2": 2, "segments_sqrt": 4, "recursive": 4, "selective": 4, "names": 4,
           "offload": 4, "offload_copy": 4}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``python -m ckpt_plugin.soak --size tiny --steps 30`` over the default modes, as a user runs it."""
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    cmd = [sys.executable, "-m", "ckpt_plugin.soak", "--size", "tiny", "--steps", "30", "--trainer-steps", "10",
           "--warmup", "2", "--out", str(out)]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-3000:]}")
    assert proc.stdout.startswith("python -m ckpt_plugin.soak --size tiny --steps 30")  # the command line first
    assert "no exact measure grew in any mode" in proc.stdout
    return json.loads(out.read_text())


def test_every_mode_ran_its_steps(results: dict) -> None:
    assert results["ok"] is True
    assert list(results["modes"]) == DEFAULT_MODES
    for mode, row in results["modes"].items():
        assert row["steps"] == (10 if mode.startswith("trainer_") else 30), mode
        base = mode.removeprefix("trainer_")
        if base in WRAPPED:
            assert row["wrapped"] == WRAPPED[base], mode
        else:
            assert row["wrapped"] > 0, mode  # auto: whatever its plan wraps


def test_no_exact_measure_grows_in_any_mode(results: dict) -> None:
    for mode, row in results["modes"].items():
        start, end = row["start"], row["end"]
        assert row["grew"] == [], (mode, row["grew"])
        for key in EXACT:
            assert end[key] <= start[key], (mode, key, start[key], end[key])
        assert end["saved_hooks"] == end["modes"] == 0, mode  # nothing left entered between steps


def test_the_measures_see_the_model(results: dict) -> None:
    """Parameters and AdamW's two moments are live at every snapshot: at least three times the weights."""
    torch.manual_seed(0)
    weights = sum(p.numel() * p.element_size() for p in soak.GPT(**soak.SIZES["tiny"]).parameters())
    for mode, row in results["modes"].items():
        for snap in (row["start"], row["end"]):
            assert snap["tensor_bytes"] >= 3 * weights, mode
            assert snap["tensors"] >= snap["storages"] > 0, mode


# -- a leak is seen ------------------------------------------------------------------------------

def _leaky(leak: str) -> tuple[Snapshot, Snapshot]:
    """Three forwards of a small GPT (not checkpointed) that each leave ``leak`` behind; snapshots around them."""
    torch.manual_seed(0)
    model = soak.GPT(**soak.SIZES["tiny"]).train()
    g = torch.Generator().manual_seed(1)
    kept, entered = [], []
    with LiveStorages() as live:
        start = Snapshot.take(model, None, live)
        for _ in range(3):
            loss = model.loss(soak._batch(model, g))
            if leak == "graph":  # a node keeps the graph and what it saved, which Python never sees
                kept.append(loss.grad_fn)
            elif leak == "hook":
                model.blocks[0].register_forward_hook(lambda *_: None)
            elif leak == "saved_hooks":
                entered.append(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
                entered[-1].__enter__()
            del loss
        end = Snapshot.take(model, None, live)
    for ctx in reversed(entered):
        ctx.__exit__(None, None, None)
    return start, end


@pytest.mark.parametrize(("leak", "grows"), [("graph", "tensor_bytes"), ("hook", "hooks"),
                                              ("saved_hooks", "saved_hooks")])
def test_a_leak_grows_its_measure(leak: str, grows: str) -> None:
    start, end = _leaky(leak)
    assert getattr(end, grows) > getattr(start, grows)
    if leak == "graph":
        assert end.tensors == start.tensors  # invisible to gc: only the storages made since show it
    if leak == "saved_hooks":
        assert end.saved_hooks - start.saved_hooks == 3


def test_exit_status_one_when_a_step_leaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    kept = []

    def leaking_batch(model, g):
        kept.append(batch := soak.MODELS["gpt"].batch(model, g))
        return batch

    monkeypatch.setattr(soak, "_batch", leaking_batch)
    out = tmp_path / "soak.json"
    assert main(["--size", "tiny", "--steps", "3", "--warmup", "1", "--modes", "full", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["modes"]["full"]
    assert "tensors" in row["grew"] and "tensor_bytes" in row["grew"]
    assert row["end"]["tensors"] - row["start"]["tensors"] == 2 * 3  # x and y of every measured step
    assert "GREW in full" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--modes", "ful"])
    assert err.value.code == 2
    assert "valid, closest first: full" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["--steps", "0"])
