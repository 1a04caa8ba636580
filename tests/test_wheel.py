"""The package as a user installs it (issue 31, point 2): a wheel built from the checkout, in a new venv.

An editable install finds every file of the checkout, so a config that ``package-data`` misses works in
every other test and fails only for users (``ckpt-inspect``: "Cannot find primary config 'inspect'", as
it did). Here the wheel is built from a copy of the working tree (``pip wheel --no-deps``, with build
isolation: setuptools comes from the index), installed with ``--no-deps`` in a new venv outside the
source tree, and run from a temporary directory:

- the wheel holds exactly the files of the packages in the source tree (a config added without
  package-data fails here), and its metadata carries the SPDX licence;
- ``ckpt_plugin``, ``ckpt_tools``, ``ckpt_examples`` and the Hydra search-path plugin import from the new
  venv, never the checkout; every ``ckpt`` preset composes with each example model and data group through
  ``ckpt-inspect``'s packaged primary config;
- ``ckpt-inspect`` measures a tiny GPT (its config, the example groups and ``corpus.txt`` from the wheel);
  ``ckpt-bench --help`` and ``ckpt-soak --help`` start;
- a Hydra app written here, ``defaults: [callbacks: activation_checkpointing]`` as in the README's "In your
  own Hydra app", trains a step with a real Trainer: the callback wraps every ``Block`` and each one's
  forward runs twice (once more in backward: it was recomputed).

The new venv borrows torch, Lightning and Hydra from the test environment instead of downloading them:
a ``.pth`` file in its site-packages names the test environment's site-packages. Python adds a ``.pth``
line to ``sys.path`` but does not process the ``.pth`` files inside the directory it names, so the
editable install's finder (``__editable__.ckpt_plugin-*.pth``) stays out; the test checks where every
package came from. Its processes take about 31 s of CPU (the five after the install run at once); 44 s
wall on 2 cores, about 65 s while other work loads them.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import STARTUP

ROOT = Path(__file__).resolve().parents[1]
# The top-level packages the wheel ships: pyproject's [tool.setuptools.packages.find] include patterns.
PACKAGES = [p.rstrip("*") for p in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]]

# Tiny enough for seconds on CPU: two blocks, 16 tokens, 2 samples (fake tensors: nothing is allocated).
INSPECT = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.block_size=16", "data.batch_size=2"]

# Run inside the new venv: where each package comes from, and every ckpt preset composed with each example
# model and data group through ckpt-inspect's primary config (pkg://ckpt_tools.configs), all from the wheel.
PROBE = '''\
import json, sys
from importlib.metadata import distribution
from importlib.resources import files

from hydra import compose, initialize_config_module

import ckpt_examples, ckpt_plugin, ckpt_tools
import hydra_plugins.ckpt_plugin_searchpath as searchpath

presets = sorted(p.name.removesuffix(".yaml") for p in files("ckpt_plugin.config").joinpath("ckpt").iterdir()
                 if p.name.endswith(".yaml"))
composed = {}
with initialize_config_module("ckpt_tools.configs", version_base="1.3"):
    for model, data in [("gpt", "text"), ("resnet", "images")]:
        for preset in presets:
            cfg = compose("inspect", overrides=[f"ckpt={preset}", f"model={model}", f"data={data}"])
            composed[f"{model}/{preset}"] = [cfg.model._target_, cfg.data._target_, cfg.ckpt.mode,
                                             cfg.callbacks.activation_checkpointing.mode]
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (ckpt_plugin, ckpt_tools, ckpt_examples, searchpath)},
    "dist": str(distribution("ckpt-plugin")._path),
    "meta_path": [repr(f) for f in sys.meta_path],
    "presets": presets,
    "composed": composed,
}))
'''

APP_CONFIG = """\
defaults:
  - callbacks: activation_checkpointing   # from the installed wheel, through its Hydra search-path plugin
  - _self_

ckpt:
  layers: Block
"""

APP = '''\
"""A user's own Hydra app: its model and data, ckpt-plugin installed from a wheel."""
import json
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckpt_plugin
from ckpt_plugin import wrapped_modules
from ckpt_plugin.lightning.app import check_app_config, config_errors_exit


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.calls = 0

    def forward(self, x):
        # Once in the forward, once more when backward recomputes it (counted first: recomputation stops
        # early). The callback's measurements on fake tensors (the over-keeping check at the first batch) are
        # not calls of the step: under fake tensors a new tensor is fake, even where the input is the real batch.
        self.calls += not ckpt_plugin._compat.is_fake(x.new_empty(()))
        return x + self.mlp(x)


class Net(pl.LightningModule):
    def __init__(self, width=16):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(3)))
        self.head = nn.Linear(width, 1)
        self.wrapped_in_step = None

    def forward(self, x):
        return self.head(self.blocks(x))

    def training_step(self, batch, batch_idx):
        self.wrapped_in_step = wrapped_modules(self)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4, 16), torch.randn(8, 4, 1)), batch_size=4)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with config_errors_exit():
        check_app_config(cfg)
        callbacks = [instantiate(c) for c in cfg.callbacks.values()]
        trainer = pl.Trainer(callbacks=callbacks, max_steps=1, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        model = Net()
        trainer.fit(model, datamodule=Data())
    Path(__file__).with_name("result.json").write_text(json.dumps({
        "callbacks": [f"{type(c).__module__}.{type(c).__name__}" for c in callbacks],
        "wrapped": callbacks[0].wrapped,
        "wrapped_in_step": model.wrapped_in_step,
        "wrapped_after": wrapped_modules(model),
        "calls": [b.calls for b in model.blocks],
        "global_step": trainer.global_step,
        "ckpt_plugin": ckpt_plugin.__file__,
    }))


if __name__ == "__main__":
    main()
'''


def _copy_source(dest: Path) -> Path:
    """The working tree without what .gitignore ignores (.venv, build/, *.egg-info, ...) and without .git.

    A copy, because setuptools builds in the tree it is given: its build/ and egg-info would land in the
    checkout, and a stale build/lib there can carry into the wheel a file the source no longer has.
    """
    patterns = [".git"] + [line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                           if line.strip() and not line.startswith("#")]
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*patterns))
    return dest


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("wheel")
    source = _copy_source(tmp / "source")
    dist = tmp / "dist"
    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
                  "-w", str(dist), str(source)], cwd=tmp, env=dict(os.environ))
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = dist.glob("ckpt_plugin-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The test environment's pip installs into the new venv (pip --python): no ensurepip, and the wheel is
    # installed before the .pth below exists, so pip sees an empty venv (not the editable ckpt-plugin).
    install = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "-q", str(wheel)], cwd=tmp, env=dict(os.environ))
    assert install.returncode == 0, install.stdout + install.stderr
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # torch, Lightning, Hydra: this environment's, in its order (the user site where the interpreter reads one)
    deps = dict.fromkeys([*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])])
    (purelib / "test_environment.pth").write_text("".join(f"{d}\n" for d in deps))

    cwd = tmp / "cwd"  # never the checkout: nothing of it is on sys.path through the working directory
    (cwd / "app" / "conf").mkdir(parents=True)
    (cwd / "app" / "train.py").write_text(APP)
    (cwd / "app" / "conf" / "config.yaml").write_text(APP_CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}  # five processes, 2 cores
    # The borrowed test environment has timm's torchvision: these interpreters import ckpt_tools first, as the
    # suite's do (conftest.py). The folder holds only that sitecustomize; ckpt_tools is the wheel's.
    env["PYTHONPATH"] = str(STARTUP)
    bin_ = venv / "bin"
    commands = {
        "probe": [str(python), "-c", PROBE],
        "inspect": [str(bin_ / "ckpt-inspect"), *INSPECT],
        "bench": [str(bin_ / "ckpt-bench"), "--help"],
        "soak": [str(bin_ / "ckpt-soak"), "--help"],
        "app": [str(python), str(cwd / "app" / "train.py"), f"hydra.run.dir={tmp / 'app-run'}"],
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = {k: pool.submit(_run, cmd, cwd, env) for k, cmd in commands.items()}
        runs = {k: f.result() for k, f in futures.items()}
    return {"source": source, "wheel": wheel, "venv": venv, "purelib": purelib, "cwd": cwd, "runs": runs}


def _output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-6000:]


def test_the_wheel_holds_every_file_of_the_packages(installed) -> None:
    source = installed["source"]
    in_source = sorted(
        p.relative_to(source).as_posix()
        for package in PACKAGES
        for p in (source / package).rglob("*")
        if p.is_file() and p.suffix != ".pyc"
    )
    with zipfile.ZipFile(installed["wheel"]) as whl:
        names = whl.namelist()
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    in_wheel = sorted(n for n in names if not n.split("/")[0].endswith(".dist-info"))
    assert any(n.endswith(".yaml") for n in in_source) and "ckpt_examples/corpus.txt" in in_source, in_source
    missing = sorted(set(in_source) - set(in_wheel))
    assert not missing, f"files of the packages the wheel lacks (add them to package-data in pyproject.toml): {missing}"
    extra = sorted(set(in_wheel) - set(in_source))
    assert not extra, f"the wheel holds files the source packages do not: {extra}"
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_everything_comes_from_the_new_venv_and_every_preset_composes(installed) -> None:
    proc = installed["runs"]["probe"]
    assert proc.returncode == 0, _output(proc)
    probe = json.loads(proc.stdout)
    purelib = installed["purelib"]
    for name, file in probe["files"].items():
        assert Path(file).is_relative_to(purelib), f"{name} imported from {file}, not the new venv's {purelib}"
    assert Path(probe["dist"]).parent == purelib, probe["dist"]
    assert not [f for f in probe["meta_path"] if "editable" in f], probe["meta_path"]  # the checkout's finder
    shipped = sorted(p.stem for p in (installed["source"] / "ckpt_plugin" / "config" / "ckpt").glob("*.yaml"))
    assert probe["presets"] == shipped
    targets = {"gpt": ["ckpt_examples.gpt.GPT", "ckpt_examples.data.TextData"],
               "resnet": ["ckpt_examples.resnet.ResNet", "ckpt_examples.data.ImageData"]}
    assert sorted(probe["composed"]) == sorted(f"{m}/{p}" for m in targets for p in shipped)
    for key, (model, data, mode, callback_mode) in probe["composed"].items():
        assert [model, data] == targets[key.split("/")[0]], key
        assert callback_mode == mode, key  # the callback node is the ckpt node (${ckpt}), resolved


def test_ckpt_inspect_measures_the_example_gpt(installed) -> None:
    proc = installed["runs"]["inspect"]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _output(proc)
    assert "GPT: one training step without and with the ckpt config" in out, _output(proc)
    rows = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  blocks.")]
    assert rows == ["blocks.0", "blocks.1"], proc.stdout
    assert "FLOPs of the step:" in proc.stdout


@pytest.mark.parametrize("tool", ["bench", "soak"])
def test_the_other_console_scripts_start(installed, tool: str) -> None:
    proc = installed["runs"][tool]
    assert proc.returncode == 0, _output(proc)
    assert proc.stdout.startswith(f"usage: ckpt-{tool} "), proc.stdout[:500]


def test_an_own_hydra_app_trains_with_the_callback_from_the_wheel(installed) -> None:
    proc = installed["runs"]["app"]
    assert proc.returncode == 0, _output(proc)
    result = json.loads((installed["cwd"] / "app" / "result.json").read_text())
    assert result["callbacks"] == ["ckpt_plugin.lightning.callback.ActivationCheckpointing"]
    assert Path(result["ckpt_plugin"]).is_relative_to(installed["purelib"]), result["ckpt_plugin"]
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    assert result["wrapped"] == blocks and result["wrapped_in_step"] == blocks
    assert result["wrapped_after"] == []  # the callback unwraps when fit ends
    assert result["global_step"] == 1
    assert result["calls"] == [2, 2, 2]  # each block recomputed in backward: checkpointing ran
