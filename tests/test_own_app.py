"""The own-app path as docs/own-app.md writes it (issue #20, point 5), with real Hydra, Lightning and data.

A. A module without ``example_input_array``: ``ckpt=auto`` takes its sample from the first
   training batch of the Trainer's data (a real ``LightningDataModule``, a real Trainer), the
   call ``training_step`` makes with it; training sees the very batches it sees without the
   plugin. A ``training_step`` that runs a submodule first gives no sample, and ``ckpt=auto``
   then says what it needs (exit code 2 in ``config_errors_exit``). The report alone does
   without, as before.
B. ``check_app_config`` with the Trainer an app builds in Python: ``ckpt=deepspeed`` is checked
   against its strategy, and without a Trainer or a ``trainer`` node it says what it left unchecked.
C. The docs' own app (docs/own-app.md's blocks) as a process (``ckpt.layers`` defaulted in its config, ``ckpt=auto`` with
   no ``example_input_array``), its ``--help`` and the recipe's: the groups a user chooses from,
   no internal schema nodes.
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import warm_python
from hydra import compose, initialize_config_dir
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_plugin import ActivationCheckpointing
from ckpt_plugin.config.hydra import register_configs
from ckpt_plugin.lightning.app import check_app_config, config_errors_exit
from ckpt_plugin.errors import ConfigError
from conftest import RECIPE
from test_docs import blocks

WIDTH = 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + self.mlp(self.norm(x))


class Net(pl.LightningModule):
    """No example_input_array; training_step computes what it passes to self(...) from the batch."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(depth)))
        self.head = nn.Linear(WIDTH, 1)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x[:, :-1]), y[:, :-1])  # a slice: computed from the batch
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CallsASubmodule(Net):
    """A training_step that calls its blocks directly, never self(...): there is no sample to take."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 9, WIDTH, generator=g), torch.randn(64, 9, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # the sampler draws from torch's RNG


def fit(model: pl.LightningModule, *callbacks: pl.Callback, steps: int = 3) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(model, datamodule=Data())
    return trainer


# --------------------------------------------------------------------------------------
# A. the sample from the first training batch
# --------------------------------------------------------------------------------------


def test_auto_plans_training_step_on_the_first_batch(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    plain = Net()
    fit(plain)  # no plugin: the losses of the batches the sampler draws
    torch.manual_seed(0)
    model, callback = Net(), ActivationCheckpointing(mode="auto", layers="Block", budget=0.6)
    fit(model, callback)
    assert model.losses == plain.losses  # the sample took nothing from the RNG the sampler draws from
    assert model.example_input_array is None
    assert all(not m._forward_pre_hooks for m in model.modules())  # nothing left on the module
    assert callback.planned.predicted_peak <= callback.planned.budget_bytes and 0 < len(callback.wrapped) <= 4
    # An example_input_array changes nothing (issue #42): what is measured is the step the trainer runs,
    # training_step on the first batch (its slice of the batch, its loss), byte for byte. (The options chosen are
    # not compared: they are timed, and two runs' timings differ on a loaded machine.)
    torch.manual_seed(0)
    given, reference = Net(), ActivationCheckpointing(mode="auto", layers="Block", budget=0.6)
    given.example_input_array = torch.zeros(8, 9, WIDTH)[:, :-1]
    fit(given, reference, steps=1)
    assert callback.report.without.total == reference.report.without.total > callback.report.with_ckpt.total


def test_auto_plans_a_training_step_that_calls_a_submodule(tmp_path, monkeypatch, caplog) -> None:
    """No self(...), no example_input_array: ckpt=auto plans the step training_step is (issue #42; it was refused)."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model, callback = CallsASubmodule(), ActivationCheckpointing(mode="auto", layers="Block", budget=0.5)
    with caplog.at_level(logging.INFO):
        fit(model, callback, steps=1)
    assert callback.planned is not None and callback.planned.predicted_peak <= callback.planned.budget_bytes
    assert "ckpt: measuring runs training_step on the first training batch" in caplog.text


class Manual(CallsASubmodule):
    """Manual optimization: its training_step steps the optimizer itself, so measuring cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()


def test_auto_without_any_sample_says_what_it_needs(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = Manual()
    stream = io.StringIO()
    with pytest.raises(SystemExit) as done, config_errors_exit(stream=stream):
        fit(model, ActivationCheckpointing(mode="auto", layers="Block", budget=0.5), steps=1)
    assert done.value.code == 2
    assert stream.getvalue() == (
        "Error: ckpt=auto measures the step the trainer runs, and Manual optimizes manually (its training_step "
        "steps the optimizers itself, so measuring cannot run it) and has no `example_input_array` (Lightning's "
        "convention for a sample input: a tensor, a tuple of arguments or a dict) to measure its forward on; set "
        "example_input_array\n(HYDRA_FULL_ERROR=1 shows the traceback.)\n"
    )
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_the_report_runs_the_step_and_leaves_no_trace(tmp_path, monkeypatch, caplog) -> None:
    """A fixed mode reports on the step the trainer runs (training_step on the first batch, issue #42); what the
    step does to the module (its list of losses) is put back: one entry after one step."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model, callback = Net(), ActivationCheckpointing(layers="Block")
    with caplog.at_level(logging.INFO):
        fit(model, callback, steps=1)
    assert callback.report is not None and len(callback.wrapped) == 4 and len(model.losses) == 1
    assert "ckpt: measuring runs training_step on the first training batch" in caplog.text
    assert callback.report.with_ckpt.total < callback.report.without.total


# --------------------------------------------------------------------------------------
# B. check_app_config and the Trainer an app builds itself
# --------------------------------------------------------------------------------------

# The app's config and train.py as docs/own-app.md shows them: the test runs the page's own blocks.
OWN_APP_PAGE = (Path(__file__).resolve().parents[1] / "docs" / "own-app.md").read_text(encoding="utf-8")
APP_CONFIG = re.search(r"^```yaml\n(# conf/config.yaml of your app\n.*?)^```", OWN_APP_PAGE, re.S | re.M).group(1)


def compose_app(conf: Path, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(APP_CONFIG)
    return tmp_path / "conf"


def test_a_default_for_ckpt_layers_in_the_apps_config(conf: Path) -> None:
    cfg = compose_app(conf)
    check_app_config(cfg)
    assert cfg.ckpt.layers == "Block" and cfg.callbacks.activation_checkpointing.layers == "Block"
    assert compose_app(conf, "ckpt.layers=Other").ckpt.layers == "Other"  # the command line still wins
    check_app_config(compose_app(conf, "ckpt=none"))  # and ckpt=none takes it as it takes every key


def test_deepspeed_is_checked_against_the_trainer_the_app_built(conf: Path, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = compose_app(conf, "ckpt=deepspeed")
    kwargs = dict(accelerator="cpu", logger=False, enable_checkpointing=False)
    check_app_config(cfg, pl.Trainer(strategy="deepspeed_stage_3", **kwargs))  # DeepSpeed: nothing to say
    with pytest.raises(ConfigError) as refused:
        check_app_config(cfg, pl.Trainer(strategy="ddp", **kwargs))
    assert str(refused.value) == (
        "ckpt.deepspeed is set (ckpt=deepspeed: DeepSpeed's own checkpoint) but the Trainer's strategy is "
        "DDPStrategy, not a DeepSpeed strategy; build the Trainer with strategy='deepspeed_stage_1', '_2' or '_3' "
        "(or a DeepSpeedStrategy); or choose another ckpt preset (torch's checkpoint works under every strategy)"
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckpt_plugin"):
        check_app_config(cfg)  # no trainer node, no Trainer: not refused, and it says what it did not check
    assert [r.getMessage() for r in caplog.records if r.name == "ckpt_plugin"] == [
        "ckpt.deepspeed: the config has no trainer node that names a strategy and no Trainer was passed "
        "(check_app_config(cfg, trainer)), so the strategy is checked when fitting starts"
    ]


# --------------------------------------------------------------------------------------
# C. the docs' own app and the recipe, as processes
# --------------------------------------------------------------------------------------

APP = next(b.body for b in blocks() if b.page == "docs/own-app.md" and b.lang == "python")

FIT_DONE = "`Trainer.fit` stopped: `max_steps=2` reached."
HELP_GROUPS = re.compile(r"== Configuration groups ==\nCompose your configuration from those groups \(group=option\)\n\n"
                         r"(.*?)\n\n", re.S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """The docs' own app trained with ckpt=auto, its --help, and the recipe's --help: three processes at once."""
    app = tmp_path_factory.mktemp("readme") / "app"
    (app / "conf").mkdir(parents=True)
    (app / "train.py").write_text(APP)
    (app / "conf" / "config.yaml").write_text(APP_CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"CUDA_VISIBLE_DEVICES": ""}
    cwd = tmp_path_factory.mktemp("recipe-help")
    commands = {
        "auto": (["train.py", f"hydra.run.dir={app.parent / 'run'}", "ckpt=auto", "ckpt.budget=0.5"], app),
        "app-help": (["train.py", "--help"], app),
        "recipe-help": ([str(RECIPE), "--help"], cwd),
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = {k: pool.submit(warm_python.run, argv, cwd=where, env=env, timeout=300)
                   for k, (argv, where) in commands.items()}
        return {k: f.result() for k, f in futures.items()}


def test_the_readme_app_plans_auto_on_its_first_batch(runs) -> None:
    proc = runs["auto"]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert FIT_DONE in out
    assert "ckpt: measuring runs training_step on the first training batch" in out
    assert "ckpt=auto plan:" in out and re.search(r"predicted activation peak .* <= budget", out), out[-4000:]
    # the ckpt.layers default of the app's config chose the candidates
    assert re.findall(r"^(blocks\.\d) +(?:keep|full|selective|inside) ", out, re.M) == [f"blocks.{i}" for i in range(4)]


def test_help_lists_the_groups_a_user_chooses(runs) -> None:
    app = runs["app-help"]
    assert app.returncode == 0, app.stderr
    assert HELP_GROUPS.search(app.stdout)[1].splitlines() == [
        "callbacks: activation_checkpointing",
        "ckpt: auto, deepspeed, full, names, none, offload, recursive, segments, selective",
    ]
    recipe = runs["recipe-help"]
    assert recipe.returncode == 0, recipe.stderr
    assert recipe.stdout.startswith("train.py: train a model with activation checkpointing (recipes/train.py).")
    assert HELP_GROUPS.search(recipe.stdout)[1].splitlines() == [
        "callbacks: activation_checkpointing, model_checkpoint",
        "ckpt: auto, deepspeed, full, names, none, offload, recursive, segments, selective",
        "data: images, text",
        "model: gpt, resnet",
        "trainer: ddp, deepspeed_zero1, deepspeed_zero2, deepspeed_zero3, deepspeed_zero3_offload, default, fsdp, "
        "model_parallel",
    ]
    assert "schema" not in app.stdout + recipe.stdout
