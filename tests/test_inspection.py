"""ckpt-inspect: one step measured without and with a config, in-process and as the console script.

It measures on fake tensors: the numbers equal a real step's, exactly, and
inspecting a batch whose step does not fit costs almost no memory.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
from pathlib import Path

import pytest
import warm_python
import torch
from conftest import TINY_GPT, TINY_RESNET, gpt_batch, resnet_batch, small_gpt, small_resnet
from torch import nn
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


def _gpt2_step():
    """A Hugging Face GPT-2 from a tiny config, called as its users train it (padded batch, labels)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :4] = 0
    # use_cache=False: recomputation would replay the KV-cache update (HF's own checkpointing forces it; issue #14).
    return model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss


def _step(name: str):
    if name == "gpt2":
        return _gpt2_step()
    if name == "resnet":
        model = small_resnet()
        batch = resnet_batch(model)
    else:
        model = small_gpt(n_layer=2)
        batch = gpt_batch(model)
    return model, lambda: model.loss(batch)


@pytest.mark.parametrize(("name", "keys"), [
    ("gpt", dict(layers="TransformerBlock")),
    ("gpt", dict(mode="selective", layers="TransformerBlock")),
    ("resnet", dict(layers="Bottleneck", segments=2)),
    ("gpt2", dict(layers="GPT2Block")),
])
def test_fake_tensors_give_every_number_of_real_steps(name, keys) -> None:
    model, step_loss = _step(name)
    real = inspect_step(model, step_loss, fake=False, **keys)
    fake = inspect_step(model, step_loss, **keys)
    # Bytes kept per module, FLOPs per module and of the step, MemTracker's peaks by category.
    assert fake == real
    assert str(fake) == str(real)
    assert fake.with_ckpt.total < fake.without.total and fake.peaks[1]["act"] < fake.peaks[0]["act"]
    # The forward's own floor (equal on fake and real tensors, above): below the peak with the config, and said.
    assert 0 < fake.floor.bytes <= fake.peaks[1]["act"]
    assert f"the forward's own floor: no checkpointing of this model goes below " in str(fake)


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if x.sum().item() > 0 else -self.inner(x)


def test_a_step_that_reads_values_is_inspected_on_fake_tensors_as_real_ones_count() -> None:
    model = ReadsValues()
    x = torch.ones(2, 4)
    fake = inspect_step(model, lambda: model(x).sum(), layers="Linear")
    real = inspect_step(model, lambda: model(x).sum(), fake=False, layers="Linear")
    assert fake.names == real.names == ["inner"]
    assert fake.values is not None and fake.values.reads == 1 and real.values is None
    assert "  the forward reads values (1 read): one forward without autograd recorded them" in str(fake)
    assert (fake.without, fake.with_ckpt, fake.flops, fake.peaks) == (real.without, real.with_ckpt, real.flops,
                                                                       real.peaks)


def _rss_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, flags=re.MULTILINE)[1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak RSS through Linux's /proc")
def test_inspecting_a_batch_that_does_not_fit_takes_almost_no_memory() -> None:
    """The process's real peak while inspecting a GPT at batch 64 grows by under a tenth of what
    the step without checkpointing keeps, which the table reports (0.48 GiB). Measured on 2 cores:
    1.5 MiB on fake tensors; 789 MiB with ``fake=False``, the same table."""
    model = small_gpt(n_layer=4, n_embd=128, n_head=4, block_size=128)
    big = gpt_batch(model, batch=64)
    inspect_step(model, lambda: model.loss(gpt_batch(model, batch=1)), layers="TransformerBlock")  # warm: lazy init
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    before = _rss_kib("VmRSS")
    result = inspect_step(model, lambda: model.loss(big), layers="TransformerBlock")
    grown = (_rss_kib("VmHWM") - before) * 1024
    assert result.without.total > 256 * 2**20 and result.peaks[0]["act"] >= result.without.total
    assert grown < result.without.total / 10, (grown, result.without.total)


def _cli(tmp_path: Path, *overrides: str, returncode: int = 0) -> str:
    exe = shutil.which("ckpt-inspect") or str(Path(os.sys.executable).parent / "ckpt-inspect")
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path / "tmp")}
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    proc = warm_python.run([exe, *overrides], env=env, cwd=cwd, timeout=300)  # the console script, run as python runs it
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []  # a measurement writes nothing where it runs: no outputs/, no .hydra/
    return proc.stdout + proc.stderr if returncode else proc.stdout


def test_console_script_help_and_errors(tmp_path: Path) -> None:
    out = _cli(tmp_path, "--help")
    assert out.startswith("ckpt-inspect: what a ckpt config does to a model, measured on one training step")
    assert ("ckpt-inspect model=yours model._target_=train.YourModule data=yours data._target_=train.YourData "
            "ckpt.layers=Block") in out
    assert "ckpt: auto, deepspeed, full, names, none, offload, recursive, segments, selective" in out
    # the example groups (added by hydra.searchpath) and ``yours``: your own app's classes by import path
    assert "\ndata: images, text, yours\nmodel: gpt, resnet, yours\n" in out
    assert "ckpt_schema" not in out and "schema" not in out.split("== Config (with your overrides) ==")[0]
    # a ckpt mistake: the message alone, exit code 2, before the model is built
    out = _cli(tmp_path, *TINY_GPT, "ckpt.every_n=0", returncode=2)
    assert out == ("Error: ckpt.every_n=0 must be >= 1: 1 wraps every matched layer, 2 every second one, ...\n"
                   "(HYDRA_FULL_ERROR=1 shows the traceback.)\n")


def test_console_script_on_the_example_models(tmp_path: Path) -> None:
    out = _cli(tmp_path, *TINY_GPT)
    assert out == _cli(tmp_path, *TINY_GPT, "fake=false")  # the same table from real steps
    assert out.splitlines()[0] == "GPT: one training step without and with the ckpt config"
    assert [line.split()[0] for line in out.splitlines()[2:7]] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "(rest"]
    assert "activation peak:" in out and "total peak:" in out
    out = _cli(tmp_path, "-m", *TINY_RESNET, "ckpt.layers=Bottleneck", "ckpt.segments=2")  # -m: a sweep of one
    out = out[out.index("ResNet: "):]  # after Hydra's "Launching 1 jobs locally"
    assert out.splitlines()[0] == "ResNet: one training step without and with the ckpt config"
    assert sum(line.strip().startswith("stages.") for line in out.splitlines()) == 6
    assert "(ratio 1." in out
