"""ckpt-inspect: one step measured without and with a config, in-process and as the console script."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from conftest import TINY_GPT, TINY_RESNET, gpt_batch, small_gpt
from torch.utils.flop_counter import FlopCounterMode

from ckpt_plugin import wrapped_modules
from ckpt_tools.inspection import inspect_step
from ckpt_plugin.measure.memory import REST


def test_inspect_step_full_on_gpt_is_exact() -> None:
    model = small_gpt()
    batch = gpt_batch(model)
    B, T, C = 2, 16, 32
    with FlopCounterMode(display=False) as counter:
        model.loss(batch)
    block_forward = sum(counter.get_flop_counts()["GPT.blocks.0"].values())
    result = inspect_step(model, lambda: model.loss(batch), layers="TransformerBlock")
    assert result.names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    for name in result.names:
        assert result.with_ckpt.by_owner[name] == B * T * C * 4  # the block's input
        assert result.without.by_owner[name] > 10 * B * T * C * 4
        assert result.recompute_flops[name] == block_forward  # one forward of the block again
    assert result.recompute_flops[REST] == 0
    f0, f1 = result.flops
    assert f1 - f0 == 4 * block_forward
    assert result.peaks[1]["act"] < result.peaks[0]["act"]
    assert wrapped_modules(model) == []  # left as it was found
    text = str(result)
    assert "GPT: one training step without and with the ckpt config" in text
    assert f"FLOPs of the step: {f0:,} without, {f1:,} with (ratio {f1 / f0:.3f})" in text


def test_inspect_step_selective_recomputes_no_matmul() -> None:
    model = small_gpt()
    batch = gpt_batch(model)
    result = inspect_step(model, lambda: model.loss(batch), mode="selective", layers="TransformerBlock")
    assert result.flops[0] == result.flops[1]
    assert all(v == 0 for v in result.recompute_flops.values())
    assert result.with_ckpt.total < result.without.total


def _cli(tmp_path: Path, *overrides: str) -> str:
    exe = shutil.which("ckpt-inspect") or str(Path(os.sys.executable).parent / "ckpt-inspect")
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [exe, f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_console_script_on_the_example_models(tmp_path: Path) -> None:
    out = _cli(tmp_path, *TINY_GPT)
    assert out.splitlines()[0] == "GPT: one training step without and with the ckpt config"
    assert [line.split()[0] for line in out.splitlines()[2:7]] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "(rest"]
    assert "activation peak:" in out and "total peak:" in out
    out = _cli(tmp_path, *TINY_RESNET, "ckpt.layers=Bottleneck", "ckpt.segments=2")
    assert out.splitlines()[0] == "ResNet: one training step without and with the ckpt config"
    assert sum(line.strip().startswith("stages.") for line in out.splitlines()) == 6
    assert "(ratio 1." in out
