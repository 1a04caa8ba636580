"""The Hydra side, end to end, with real Hydra and real Lightning (no mocks).

A. Every YAML preset (the ckpt, model, data and trainer groups, wherever each lives; found by glob, so new
   presets are picked up) composes into ``train.yaml`` and instantiates.
B. ``recipes/train.py`` as a subprocess: what each ``ckpt.*`` override wraps,
   read from the table the callback prints.
C. A user's own Hydra app outside the repo: ``callbacks: activation_checkpointing``
   resolves from the installed package (search-path plugin) and works there. Where the
   package is not installed (the GPU check's machines), from the checkout on PYTHONPATH.

B and C start subprocesses (~5-10 s each, mostly imports). They are launched
together, on a small thread pool, as soon as the first test of this module
runs, and each test waits for its own run; only the runs of the selected tests
are started (``-k`` works as usual).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import warm_python
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ckpt_plugin import ActivationCheckpointing
from ckpt_plugin.config.schema import MODES
from ckpt_plugin.config.deepspeed import DeepSpeedCheckpointing
from ckpt_examples.data import ImageData, TextData
from ckpt_examples.gpt import GPT
from ckpt_examples.resnet import ResNet
from conftest import GROUP_DIRS, FAST, TINY_GPT, TINY_RESNET, compose_train, run_recipe


def _presets(group: str) -> list[str]:
    names = sorted(p.stem for p in GROUP_DIRS[group].glob("*.yaml"))
    assert names, f"no presets found in {GROUP_DIRS[group]}"
    return names


# --------------------------------------------------------------------------------------
# Reading the output
# --------------------------------------------------------------------------------------

FIT_DONE = "`Trainer.fit` stopped: `max_steps=2` reached."
OFF = "Activation checkpointing is off (ckpt=none)."
_TABLE_HEAD = re.compile(r"^Activation checkpointing wrapped (\d+) module\(s\) of (\w+) \(ckpt=[^)]*\); kept for backward",
                         re.M)


def _output(proc: subprocess.CompletedProcess) -> str:
    # Lightning's rank_zero_info goes through logging (stderr); search both streams.
    return proc.stdout + proc.stderr


def wrapped_table(text: str) -> tuple[str, dict[str, str]]:
    """(model class, {wrapped module name: its class}) from the one table the callback printed."""
    heads = list(_TABLE_HEAD.finditer(text))
    assert len(heads) == 1, f"expected one 'Activation checkpointing wrapped' table, found {len(heads)}:\n{text}"
    head = heads[0]
    lines = text[head.end() :].splitlines()[1:]  # rest of the heading line dropped
    assert lines and lines[0].split()[:2] == ["module", "class"], f"no table header after the heading:\n{text}"
    rows: dict[str, str] = {}
    for line in lines[1:]:
        if line.strip().startswith("(rest of model)"):
            break
        name, cls, *_ = line.split()
        rows[name] = cls
    else:
        raise AssertionError(f"table has no '(rest of model)' row:\n{text}")
    assert len(rows) == int(head.group(1)), f"heading says {head.group(1)} modules, table lists {list(rows)}"
    return head.group(2), rows


# --------------------------------------------------------------------------------------
# B/C: the subprocess runs, started together in the background
# --------------------------------------------------------------------------------------

GPT_BLOCKS = {f"blocks.{i}": "TransformerBlock" for i in range(4)}  # TINY_GPT has 4 layers

# case id -> (overrides after TINY_* + FAST, expected model class, expected {module: class}; None: off)
RECIPE_CASES: dict[str, tuple[list[str], str, dict[str, str] | None]] = {
    "default": ([*TINY_GPT], "GPT", GPT_BLOCKS),
    "class-name": ([*TINY_GPT, "ckpt.layers=TransformerBlock"], "GPT", GPT_BLOCKS),
    "class-list": ([*TINY_GPT, "ckpt.layers=[TransformerBlock]"], "GPT", GPT_BLOCKS),
    "dotted-class-path": ([*TINY_GPT, "ckpt.layers=ckpt_examples.gpt.TransformerBlock"], "GPT", GPT_BLOCKS),
    # 'blocks.*' also matches blocks.0.attn, blocks.0.mlp.fc, ...: only the outermost are wrapped.
    "glob": ([*TINY_GPT, "ckpt.layers=blocks.*"], "GPT", GPT_BLOCKS),
    # quoted for Hydra's override grammar ('[' would start a list), as on a shell command line
    "regex": (
        [*TINY_GPT, r"ckpt.layers='re:blocks\.[02]'"],
        "GPT",
        {"blocks.0": "TransformerBlock", "blocks.2": "TransformerBlock"},
    ),
    "every-n-2": (
        [*TINY_GPT, "ckpt.every_n=2"],
        "GPT",
        {"blocks.1": "TransformerBlock", "blocks.3": "TransformerBlock"},
    ),
    "no-rng-replay": ([*TINY_GPT, "ckpt.preserve_rng_state=false"], "GPT", GPT_BLOCKS),
    "ckpt-none": ([*TINY_GPT, "ckpt=none"], "GPT", None),
    "resnet-resstage": (
        [*TINY_RESNET, "ckpt.layers=ResStage"],
        "ResNet",
        {f"stages.{i}": "ResStage" for i in range(3)},
    ),
    "resnet-bottleneck": (
        [*TINY_RESNET, "ckpt.layers=Bottleneck"],
        "ResNet",
        {f"stages.{s}.{b}": "Bottleneck" for s in range(3) for b in range(2)},  # depths [2, 2, 2]
    ),
}

USER_APP = '''\
"""A user's own training script: its own model, its own config, ckpt-plugin only installed."""
import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.linear(x))


class Net(pl.LightningModule):
    def __init__(self, width: int, batch_size: int) -> None:
        super().__init__()
        self.body = nn.Sequential(Layer(width), Layer(width), Layer(width))
        self.head = nn.Linear(width, 1)
        self.example_input_array = torch.zeros(batch_size, width)

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, cfg.width), torch.randn(32, 1))
    callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(Net(cfg.width, cfg.batch_size), DataLoader(data, batch_size=cfg.batch_size))


if __name__ == "__main__":
    main()
'''

USER_CONFIG = """\
defaults:
  - callbacks: activation_checkpointing
  - _self_

width: 8
batch_size: 4
"""

# run id -> the user app's overrides
APP_RUNS: dict[str, list[str]] = {
    "layers": ["ckpt.layers=Layer"],
    "every-n-2": ["ckpt.layers=Layer", "ckpt.every_n=2"],
    "none": ["ckpt=none"],
    "missing-layers": [],
}
# test function -> the app run it reads
APP_TESTS = {
    "test_user_app_uses_the_installed_preset": "layers",
    "test_user_app_every_n": "every-n-2",
    "test_user_app_ckpt_none": "none",
    "test_user_app_without_layers_names_ckpt_layers": "missing-layers",
}


@cache
def _installed() -> bool:
    """Whether this interpreter imports ckpt_plugin with nothing of the repo on its path: pip installed it.

    ``-I``: no PYTHONPATH, no working directory (nor user site) on ``sys.path``; an editable install still counts.
    """
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('ckpt_plugin') is None)"
    return subprocess.run([sys.executable, "-I", "-c", probe], timeout=60).returncode == 0


def run_user_app(app: Path, overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """``python train.py ...`` in the user's app folder, as the user would type it."""
    args = ["train.py", f"hydra.run.dir={run_dir}", *overrides]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    if _installed():
        env.pop("PYTHONPATH", None)  # the installed package alone: nothing of the repo on the path
    # Else (the GPU check's machines, docs/gpu.md: the checkout and the carried wheels on PYTHONPATH, nothing
    # installed) the app reaches the package as that environment does, and Hydra finds the same search-path
    # plugin, the checkout's hydra_plugins/, by the same scan of sys.path. With neither, the app fails: no skip,
    # so that a broken install fails here.
    return warm_python.run(args, env=env, cwd=app, timeout=600)


class Runs:
    def __init__(self) -> None:
        self.futures: dict[str, Future] = {}
        self.dirs: dict[str, Path] = {}

    def get(self, run_id: str) -> subprocess.CompletedProcess:
        if run_id not in self.futures:
            pytest.fail(f"run {run_id!r} was not started: is the test mapped in RECIPE_CASES/APP_TESTS?")
        return self.futures[run_id].result()


@pytest.fixture(scope="module", autouse=True)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Start the subprocess runs of the selected tests of this module, in parallel."""
    wanted: list[str] = []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "case" in params and item.originalname == "test_recipe":
            wanted.append(f"recipe:{params['case']}")
        elif item.originalname in APP_TESTS:
            wanted.append(f"app:{APP_TESTS[item.originalname]}")

    result = Runs()
    if not wanted:
        yield result
        return
    app = None
    if any(w.startswith("app:") for w in wanted):
        app = tmp_path_factory.mktemp("user") / "app"
        (app / "conf").mkdir(parents=True)
        (app / "train.py").write_text(USER_APP)
        (app / "conf" / "config.yaml").write_text(USER_CONFIG)
    workers = min(len(wanted), max(3, (os.cpu_count() or 2) + 1))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hydra-run")
    try:
        for run_id in dict.fromkeys(wanted):
            kind, name = run_id.split(":", 1)
            tmp = tmp_path_factory.mktemp(f"{kind}-{name}")
            if kind == "recipe":
                result.dirs[run_id] = tmp / "run"  # conftest.run_recipe: hydra.run.dir=<tmp>/run
                overrides = [*RECIPE_CASES[name][0], *FAST]
                result.futures[run_id] = pool.submit(run_recipe, *overrides, tmp_path=tmp)
            else:
                result.dirs[run_id] = tmp / "run"
                result.futures[run_id] = pool.submit(run_user_app, app, APP_RUNS[name], tmp / "run")
        yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------
# A. Every preset composes and instantiates
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _presets("ckpt"))
def test_ckpt_preset_instantiates_the_callback(name: str) -> None:
    cfg = compose_train(f"ckpt={name}", *PRESET_NEEDS.get(name, []))
    callback = instantiate(cfg.callbacks.activation_checkpointing)
    assert isinstance(callback, ActivationCheckpointing)
    # A preset named after a mode selects it; the others refine one (names -> selective, ...).
    assert callback.config.mode == PRESET_MODES.get(name, name)
    assert callback.config.mode in MODES


# What a preset needs from the user beyond ckpt.layers (which model/gpt.yaml gives).
PRESET_NEEDS = {"auto": ["ckpt.budget=0.5"]}

# The presets that are not a mode's own file, and what each must set beyond its mode.
PRESET_MODES = {"names": "selective", "segments": "full", "recursive": "full", "deepspeed": "full"}


def test_refining_presets_set_their_keys() -> None:
    names = instantiate(compose_train("ckpt=names").callbacks.activation_checkpointing).config
    assert (names.policy, list(names.save_names)) == ("names", ["attn_out"])
    assert instantiate(compose_train("ckpt=segments").callbacks.activation_checkpointing).config.segments == "sqrt"
    assert instantiate(compose_train("ckpt=recursive").callbacks.activation_checkpointing).config.segments == "recursive"
    deepspeed = instantiate(compose_train("ckpt=deepspeed").callbacks.activation_checkpointing).config.deepspeed
    assert deepspeed == DeepSpeedCheckpointing()  # every option present, at DeepSpeed's defaults


MODEL_CLASSES = {"gpt": (GPT, TextData), "resnet": (ResNet, ImageData)}


@pytest.mark.parametrize("name", _presets("model"))
def test_model_preset_instantiates_model_and_its_data(name: str) -> None:
    cfg = compose_train(f"model={name}")
    model = instantiate(cfg.model)
    data = instantiate(cfg.data)
    assert isinstance(model, pl.LightningModule)
    assert isinstance(data, pl.LightningDataModule)
    if name in MODEL_CLASSES:  # a new preset: at least the two Lightning types above
        model_cls, data_cls = MODEL_CLASSES[name]
        assert type(model) is model_cls
        assert type(data) is data_cls, f"model={name} should bring {data_cls.__name__}, got {type(data).__name__}"
    # the model preset's own ckpt.layers default makes the callback buildable as is
    callback = instantiate(cfg.callbacks.activation_checkpointing)
    assert callback.config.mode == "full" and callback.config.layers


DATA_CLASSES = {"text": TextData, "images": ImageData}


@pytest.mark.parametrize("name", _presets("data"))
def test_data_preset_instantiates(name: str) -> None:
    cfg = compose_train(f"data={name}")
    data = instantiate(cfg.data)
    assert isinstance(data, pl.LightningDataModule)
    if name in DATA_CLASSES:
        assert type(data) is DATA_CLASSES[name]


# Presets whose Lightning strategy refuses CPU: their strategy is built on its own here;
# tests/test_strategies.py trains with each through a CPU subclass.
GPU_ONLY = {"fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload"}
STRATEGIES = {"ddp": "DDPStrategy", "fsdp": "FSDPStrategy", "model_parallel": "ModelParallelStrategy",
              "deepspeed_zero1": "DeepSpeedStrategy", "deepspeed_zero2": "DeepSpeedStrategy",
              "deepspeed_zero3": "DeepSpeedStrategy", "deepspeed_zero3_offload": "DeepSpeedStrategy"}
# Lightning's DeepSpeedStrategy refuses to be built without DeepSpeed installed (MisconfigurationException). The
# test extra installs it; the GPU check's machines have none (docs/gpu.md), and there these presets skip.
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed: Lightning's DeepSpeedStrategy cannot be built")


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_deepspeed) if STRATEGIES.get(n) == "DeepSpeedStrategy"
                                  else n for n in _presets("trainer")])
def test_trainer_preset_instantiates(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a Trainer writes lands here
    cfg = compose_train(f"trainer={name}")
    if name in GPU_ONLY:
        strategy = instantiate(cfg.trainer.strategy)
        assert type(strategy).__name__ == STRATEGIES[name]
        return
    trainer = instantiate(cfg.trainer, accelerator="cpu")
    assert isinstance(trainer, pl.Trainer)
    assert trainer.max_steps == cfg.trainer.get("max_steps", -1)
    if name in STRATEGIES:
        assert type(trainer.strategy).__name__ == STRATEGIES[name]


@needs_deepspeed
def test_deepspeed_presets_set_their_stage() -> None:
    for stage in (1, 2, 3):
        assert instantiate(compose_train(f"trainer=deepspeed_zero{stage}").trainer.strategy).config["zero_optimization"]["stage"] == stage
    offload = instantiate(compose_train("trainer=deepspeed_zero3_offload").trainer.strategy)
    zero = offload.config["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"], zero["offload_param"]["device"]) == (3, "cpu", "cpu")


# --------------------------------------------------------------------------------------
# B. recipes/train.py as a subprocess
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_recipe(case: str, runs: Runs) -> None:
    _, model, expected = RECIPE_CASES[case]
    proc = runs.get(f"recipe:{case}")  # run_recipe raised already if the exit status was not 0
    text = _output(proc)
    assert FIT_DONE in text, text
    if expected is None:
        assert OFF in text, text
        assert "Activation checkpointing wrapped" not in text, text
        return
    assert OFF not in text
    assert wrapped_table(text) == (model, expected)
    if case == "no-rng-replay":  # the override reached the callback's config
        saved = OmegaConf.load(runs.dirs[f"recipe:{case}"] / ".hydra" / "config.yaml")
        assert saved.ckpt.preserve_rng_state is False


# --------------------------------------------------------------------------------------
# C. The user's own Hydra app, outside the repo
# --------------------------------------------------------------------------------------

USER_LAYERS = {f"body.{i}": "Layer" for i in range(3)}


def _ok(proc: subprocess.CompletedProcess) -> str:
    text = _output(proc)
    assert proc.returncode == 0, f"user app failed ({proc.returncode}):\n{text[-5000:]}"
    assert FIT_DONE in text, text
    return text


def test_user_app_uses_the_installed_preset(runs: Runs) -> None:
    text = _ok(runs.get("app:layers"))
    assert wrapped_table(text) == ("Net", USER_LAYERS)
    # callbacks/activation_checkpointing.yaml (and ckpt/full.yaml) came from the package, not the app
    hydra_cfg = OmegaConf.load(runs.dirs["app:layers"] / ".hydra" / "hydra.yaml").hydra
    sources = [(s.provider, s.schema, s.path) for s in hydra_cfg.runtime.config_sources]
    assert ("ckpt-plugin", "pkg", "ckpt_plugin.config") in sources, sources
    assert hydra_cfg.runtime.choices.callbacks == "activation_checkpointing"
    assert hydra_cfg.runtime.choices.ckpt == "full"
    assert not (Path(hydra_cfg.runtime.cwd) / "conf" / "callbacks").exists()


def test_user_app_every_n(runs: Runs) -> None:
    assert wrapped_table(_ok(runs.get("app:every-n-2"))) == ("Net", {"body.1": "Layer"})


def test_user_app_ckpt_none(runs: Runs) -> None:
    # `ckpt=none` alone (callbacks/activation_checkpointing.yaml: "or ckpt=none"): the user's
    # config names no layers, and none needs none
    text = _ok(runs.get("app:none"))
    assert OFF in text, text
    assert "Activation checkpointing wrapped" not in text


def test_user_app_without_layers_names_ckpt_layers(runs: Runs) -> None:
    proc = runs.get("app:missing-layers")
    text = _output(proc)
    assert proc.returncode != 0, text
    assert FIT_DONE not in text
    # The callback refuses the preset's `layers: null` when Hydra instantiates it, with our message
    assert "ckpt.layers is required: name the modules to checkpoint, e.g. ckpt.layers=TransformerBlock" in proc.stderr, proc.stderr
