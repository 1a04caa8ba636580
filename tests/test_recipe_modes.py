"""Every ckpt preset from the entry point, as a user runs it: one Hydra --multirun subprocess."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import warm_python
from conftest import FAST, RECIPE, TINY_GPT, TINY_RESNET
from omegaconf import OmegaConf

PRESETS = ["selective", "names", "segments", "recursive", "offload"]
TABLE = re.compile(r"wrapped (\d+) module\(s\) of (\w+) \(ckpt=[^)]*\);.*?\n  total\s+([\d.]+ \w+)\s+([\d.]+ \w+)", re.S)
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def multirun(tmp_path: Path, *overrides: str) -> tuple[str, Path]:
    sweep = tmp_path / "sweep"
    args = [str(RECIPE), "-m", f"hydra.sweep.dir={sweep}", *overrides]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    proc = warm_python.run(args, env=env, cwd=tmp_path, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out, sweep


@pytest.fixture(scope="module")
def presets(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return multirun(tmp_path_factory.mktemp("presets"), *TINY_GPT, *FAST, f"ckpt={','.join(PRESETS)}")


def test_every_preset_trains_from_the_entry_point(presets) -> None:
    out, sweep = presets
    assert out.count("`Trainer.fit` stopped: `max_steps=2` reached.") == len(PRESETS)
    modes = [OmegaConf.load(sweep / str(i) / ".hydra" / "config.yaml").ckpt.mode for i in range(len(PRESETS))]
    assert modes == ["selective", "selective", "full", "full", "offload"]


def test_each_preset_saves_what_it_should(presets) -> None:
    out, _ = presets
    tables = TABLE.findall(out)
    assert [(n, m) for n, m, *_ in tables] == [("4", "GPT")] * len(PRESETS)
    saved = {p: (_bytes(w), _bytes(c)) for p, (_n, _m, w, c) in zip(PRESETS, tables)}
    without = saved["selective"][0]
    assert all(w == without for w, _ in saved.values())  # the same model every time
    # Checkpointing presets keep less; saving matmul outputs keeps more than saving one
    # tagged tensor per block, which keeps more than block inputs alone.
    assert saved["segments"][1] <= saved["recursive"][1] < saved["names"][1] < saved["selective"][1] < without
    # Offload on CPU moves nothing: what is kept is what the plain run keeps, and it says so.
    assert saved["offload"][1] == without
    assert out.count("there is nothing to move") == 1


def test_design_example_bottleneck_segments_with_offload(tmp_path: Path) -> None:
    """DESIGN.md's `ckpt.layers=[Bottleneck] ckpt.segments=2 ckpt.offload=true`, on the ResNet."""
    out, sweep = multirun(
        tmp_path, *TINY_RESNET, *FAST, "ckpt.layers=[Bottleneck]", "ckpt.segments=2", "ckpt.offload=true"
    )
    ((count, model, without, with_ckpt),) = TABLE.findall(out)
    assert (count, model) == ("6", "ResNet")
    assert _bytes(with_ckpt) < _bytes(without)
    assert OmegaConf.load(sweep / "0" / ".hydra" / "config.yaml").ckpt.segments == 2


def test_auto_from_the_entry_point_prints_its_plan(tmp_path: Path) -> None:
    out, sweep = multirun(tmp_path, *TINY_GPT, *FAST, "ckpt=auto", "ckpt.budget=0.5")
    assert "ckpt=auto plan:" in out and "<= budget" in out
    ((count, model, without, with_ckpt),) = TABLE.findall(out)
    assert model == "GPT" and int(count) >= 1
    assert _bytes(with_ckpt) <= 0.5 * _bytes(without)
    assert OmegaConf.load(sweep / "0" / ".hydra" / "config.yaml").ckpt.budget == 0.5


def test_budget_min_composes_and_reaches_the_callback() -> None:
    from conftest import compose_train
    from hydra.utils import instantiate

    from ckpt_plugin.lightning.app import check_app_config

    cfg = compose_train("ckpt=auto", "ckpt.budget=min")
    check_app_config(cfg)  # the typed checks a Hydra app runs: "min" is a budget, not a slip
    callback = instantiate(cfg.callbacks.activation_checkpointing)
    assert callback.config.budget == "min"


def test_auto_without_a_budget_is_an_error(tmp_path: Path) -> None:
    from conftest import compose_train
    from hydra.utils import instantiate

    cfg = compose_train("ckpt=auto")
    with pytest.raises(Exception, match=r"ckpt=auto needs ckpt\.budget: a fraction of the activation peak "
                       r"without checkpointing \(0\.4\) or a size \(2GiB\)"):
        instantiate(cfg.callbacks.activation_checkpointing)
