"""ckpt-soak: a short run of every mode leaks nothing, and a leak is seen.

Counts of tensors, storage bytes and hooks are exact and asserted; timings and RSS never are.
"""

from __future__ import annotations

import gc
import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tools import soak
from ckpt_tools.soak import DEFAULT_MODES, LiveStorages, Snapshot, main

EXACT = Snapshot.EXACT
WRAPPED = {"none": 0, "full": 4, "every_n_2": 2, "segments_sqrt": 4, "recursive": 4, "selective": 4, "names": 4,
           "offload": 4, "offload_copy": 4}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict]:
    """``ckpt-soak --steps 15 ...`` over the default modes through ``main`` (about 15 s); exit status, stdout, JSON.

    In this process rather than a subprocess: importing torch and Lightning again would cost a third of
    the time. The soak's measures compare snapshots taken inside it, so what other tests left does not count.
    """
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    args = ["--steps", "15", "--trainer-steps", "5", "--warmup", "2", "--out", str(out)]
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(sys, "argv", ["/venv/bin/ckpt-soak"])  # as the console script runs it
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        status = main(args)
    assert stdout.getvalue().startswith(f"ckpt-soak {' '.join(args)}\n")  # the command line comes first
    return status, stdout.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(run: tuple[int, str, dict]) -> dict:
    return run[2]


def test_every_mode_ran_its_steps(results: dict) -> None:
    assert list(results["modes"]) == DEFAULT_MODES
    for mode, row in results["modes"].items():
        assert row["steps"] == (5 if mode.startswith("trainer_") else 15), mode
        base = mode.removeprefix("trainer_")
        if base in WRAPPED:
            assert row["wrapped"] == WRAPPED[base], mode
        else:
            assert row["wrapped"] > 0, mode  # auto: whatever its plan wraps


def test_no_exact_measure_grows_in_any_mode(run: tuple[int, str, dict]) -> None:
    _, stdout, results = run
    assert "GREW" not in stdout
    for mode, row in results["modes"].items():
        start, end = row["start"], row["end"]
        assert row["grew"] == [], (mode, row["grew"])
        for key in EXACT:
            assert end[key] <= start[key], (mode, key, start[key], end[key])
        assert end["saved_hooks"] == end["modes"] == 0, mode  # nothing left entered between steps


def test_no_mode_leaves_anything_behind(run: tuple[int, str, dict]) -> None:
    status, stdout, results = run
    for mode, row in results["modes"].items():
        assert row["left"] == [], (mode, row["before"], row["after"])
        for key in soak.LEFT:
            assert row["after"][key] == row["before"][key], (mode, key)
    assert status == 0 and results["ok"] is True
    assert "no exact measure grew in any mode, and no mode left anything behind" in stdout


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
    gc.collect()
    gc.freeze()  # as ckpt-soak does: the test process's objects out of the snapshots' scan (seconds)
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
    gc.unfreeze()
    for ctx in reversed(entered):
        ctx.__exit__(None, None, None)
    return start, end


@pytest.mark.parametrize(("leak", "grows"), [("graph", "tensor_bytes"), ("hook", "hooks"),
                                              ("saved_hooks", "saved_hooks")])
def test_a_leak_grows_its_measure(leak: str, grows: str) -> None:
    start, end = _leaky(leak)
    assert getattr(end, grows) > getattr(start, grows)
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
    assert main(["--steps", "3", "--warmup", "1", "--modes", "full", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["modes"]["full"]
    assert "tensors" in row["grew"] and "tensor_bytes" in row["grew"]
    assert row["end"]["tensors"] - row["start"]["tensors"] == 2 * 3  # x and y of every measured step
    assert "GREW in full" in capsys.readouterr().out


def test_exit_status_one_when_a_mode_leaves_its_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    kept = []

    class KeptGPT(soak.GPT):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            kept.append(self)

    monkeypatch.setattr(soak, "GPT", KeptGPT)
    out = tmp_path / "soak.json"
    assert main(["--steps", "2", "--warmup", "1", "--modes", "none", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["modes"]["none"]
    assert row["grew"] == [] and {"tensors", "tensor_bytes"} <= set(row["left"])
    params = sum(1 for _ in kept[0].parameters())
    assert row["after"]["tensors"] - row["before"]["tensors"] == params + 1  # and example_input_array
    assert "LEFT tensors or hooks behind: none" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--modes", "ful"])
    assert err.value.code == 2
    assert "valid, closest first: full" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["--steps", "0"])
