"""The callback under LightningCLI: its typed signature, and ``examples/lightning_cli.py`` run as a user runs it.

In process: the keyword arguments are exactly the ``ckpt`` keys, and None
means "the mode's default" while a key the mode lacks is still refused.

Subprocesses (real LightningCLI, real jsonargparse, no mocks), four, started
together when the first of them is asked for:

- ``yaml``:  ``fit --config examples/lightning_cli.yaml`` (``init_args: {layers: Block}``)
- ``flags``: the callback added and configured on the command line, ``mode=auto`` with a
  ``budget``: the typed values parse, and ckpt=auto says it is measuring before it measures
- ``help``:  ``fit --trainer.callbacks.help ckpt_plugin.ActivationCheckpointing``
- ``typo``:  ``--trainer.callbacks.layrs=Block`` refused, naming the option
"""

from __future__ import annotations

import inspect
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import warm_python
from conftest import ROOT

from ckpt_plugin import ActivationCheckpointing, ConfigError, FullConfig, OffloadConfig
from ckpt_plugin.config.schema import MODES, user_keys

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the test extra)")
from docstring_parser import parse as parse_docstring  # noqa: E402  (jsonargparse[signatures] brings it)

SCRIPT = ROOT / "examples" / "lightning_cli.py"
CONFIG = ROOT / "examples" / "lightning_cli.yaml"
QUIET = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
         "--trainer.enable_model_summary=false", "--trainer.enable_progress_bar=false", "--seed_everything=0"]
ADD = "--trainer.callbacks+=ckpt_plugin.ActivationCheckpointing"

RUNS = {
    "yaml": ["fit", f"--config={CONFIG}"],
    # every_n=2 leaves blocks.1 and blocks.3 as candidates. Their smallest reachable peak is 0.73 of the peak
    # without checkpointing (both full); with either one kept it is above 0.9, so a budget of 0.75 is met only
    # by wrapping both, whatever the timings: the planner's choice is exact here.
    "flags": ["fit", ADD, "--trainer.callbacks.mode=auto", "--trainer.callbacks.layers=Block",
              "--trainer.callbacks.every_n=2", "--trainer.callbacks.budget=0.75", "--trainer.max_steps=2", *QUIET],
    "help": ["fit", "--trainer.callbacks.help", "ckpt_plugin.ActivationCheckpointing"],
    "typo": ["fit", ADD, "--trainer.callbacks.layrs=Block", "--trainer.max_steps=2", *QUIET],
}
FIT_DONE = "`Trainer.fit` stopped: `max_steps=2` reached."
_TABLE = re.compile(r"^Activation checkpointing wrapped (\d+) module\(s\) of Model \(ckpt=[^)]*\); kept for backward after "
                    r"one forward:\n  module +class +(?:option +)?without +with\n((?:  blocks\.\d+\S* .*\n)*)", re.M)


class Runs:
    """The four runs, started together (each ~5 s as a new interpreter, mostly imports); ``get`` waits for one."""

    def __init__(self, tmp: Path) -> None:
        env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
        self.pool = ThreadPoolExecutor(len(RUNS), thread_name_prefix="cli-run")
        self.procs: dict[str, Future] = {}
        for name, args in RUNS.items():
            cwd = tmp / name  # LightningCLI writes its config.yaml to the working directory (logger: false)
            cwd.mkdir()
            self.procs[name] = self.pool.submit(warm_python.run, [str(SCRIPT), *args], cwd=cwd, env=env, timeout=600)

    def get(self, name: str) -> tuple[int, str]:
        proc = self.procs[name].result()
        return proc.returncode, proc.stdout + proc.stderr

    def ok(self, name: str) -> str:
        rc, out = self.get(name)
        assert rc == 0, f"{name} exited {rc}:\n{out[-5000:]}"
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    started = Runs(tmp_path_factory.mktemp("cli"))
    yield started
    started.close()


def wrapped(out: str) -> dict[str, str]:
    """{module: class} from the one wrap table the callback logged: its rows but those ckpt=auto kept."""
    (table,) = _TABLE.findall(out)
    count, rows = table
    names = dict(line.split()[:2] for line in rows.splitlines() if line.split()[2] != "keep")
    assert len(names) <= int(count), out  # ckpt=auto's row of a layer it went inside of: one part wrapped or more
    return names


# ---------------------------------------------------------------------------------------- in process


def test_one_keyword_per_ckpt_key_each_documented() -> None:
    params = inspect.signature(ActivationCheckpointing).parameters
    keys = {"mode"} | {key for cls in MODES.values() for key in user_keys(cls)}
    named = {name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert named == keys
    # and **misspelt, only so that a Python caller's typo gets make_config's "did you mean" (test_errors.py)
    assert [(name, p.kind) for name, p in params.items() if name not in named] == [
        ("misspelt", inspect.Parameter.VAR_KEYWORD)]
    documented = {p.arg_name: p.description for p in parse_docstring(ActivationCheckpointing.__doc__).params}
    assert set(documented) == keys and all(documented.values())


def test_unset_keys_take_the_mode_defaults() -> None:
    assert ActivationCheckpointing(layers="Block").config == FullConfig(layers=("Block",))
    # offload has no preserve_rng_state, check_recompute, segments, offload or deepspeed: unset, they are not passed
    assert ActivationCheckpointing(mode="offload", layers="Block").config == OffloadConfig(layers=("Block",))
    auto = ActivationCheckpointing(mode="auto", layers="Block", budget=0.5).config
    assert (auto.every_n, auto.preserve_rng_state, auto.budget) == (1, True, 0.5)
    # what Hydra's instantiate passes for ckpt=full: every key of its node, the nulls included
    hydra_full = dict(mode="full", layers="Block", every_n=1, preserve_rng_state=True, check_recompute=False,
                      segments=None, offload=False, deepspeed=None)
    assert ActivationCheckpointing(**hydra_full).config == FullConfig(layers=("Block",))


def test_a_key_the_mode_lacks_is_refused_when_given() -> None:
    with pytest.raises(ConfigError, match=re.escape(
        "unknown key ckpt.policy for ckpt mode 'full'; valid keys: layers, every_n, sample, preserve_rng_state, "
        "check_recompute, segments, offload, budget, deepspeed, compile"
    )):
        ActivationCheckpointing(mode="full", layers="Block", policy="matmuls")
    with pytest.raises(ConfigError, match=re.escape(
        "unknown key ckpt.preserve_rng_state for ckpt mode 'offload'; valid keys: layers, every_n, sample, compile"
    )):
        ActivationCheckpointing(mode="offload", layers="Block", preserve_rng_state=True)


# ---------------------------------------------------------------------------------------- LightningCLI


def test_yaml_config_wraps_every_block(runs: Runs) -> None:
    out = runs.ok("yaml")
    assert wrapped(out) == {f"blocks.{i}": "Block" for i in range(4)}
    assert FIT_DONE in out


def test_command_line_flags_configure_the_callback(runs: Runs) -> None:
    out = runs.ok("flags")
    # every_n=2, both needed for budget=0.75: each block, or a part of it (ckpt=auto may go inside a block)
    assert {".".join(name.split(".")[:2]) for name in wrapped(out)} == {"blocks.1", "blocks.3"}
    assert FIT_DONE in out
    # ckpt=auto says what it does before it profiles, then what it chose, then what it wrapped
    measuring = out.index("ckpt=auto: measuring the candidate layers (memory on fake tensors, step time one layer "
                          "at a time) to plan for ckpt.budget...")
    planned = out.index("ckpt=auto plan:")
    assert measuring < planned < out.index("Activation checkpointing wrapped 2 module(s) of Model")
    assert re.search(r"<= budget [\d.]+ KiB \(\d+ B\)", out[planned:]), out


def _type_of(flat: str, key: str) -> tuple[str, str]:
    """The ``(type: ..., default: ...)`` shown for ``--trainer.callbacks.<key>`` in the list of options.

    jsonargparse spells types its own way from release to release (``int | null``, ``Optional[int]``):
    the checks below read the names in it, not the spelling."""
    tail = flat.rsplit(f"--trainer.callbacks.{key} ", 1)[1]  # the last mention: the options, not the usage line
    return re.search(r"\(type: (.*?), default: ([^)]*)\)", tail).groups()


def test_help_lists_every_key_with_its_type_and_meaning(runs: Runs) -> None:
    out = runs.ok("help")
    flat = " ".join(out.split())  # argparse wraps the descriptions at the terminal width
    for param in parse_docstring(ActivationCheckpointing.__doc__).params:
        assert f"--trainer.callbacks.{param.arg_name} " in out, param.arg_name
        assert " ".join(param.description.split()) in flat, param.arg_name
        assert _type_of(flat, param.arg_name), param.arg_name
    assert _type_of(flat, "mode") == ("str", "full")
    every_n, default = _type_of(flat, "every_n")
    assert set(re.findall(r"\w+", every_n)) - {"Optional", "None", "null"} == {"int"} and default == "null", every_n
    budget, default = _type_of(flat, "budget")
    assert {"int", "float", "str"} <= set(re.findall(r"\w+", budget)) and default == "null", budget


def test_a_misspelt_option_is_refused_by_name(runs: Runs) -> None:
    rc, out = runs.get("typo")
    assert rc == 2, out
    assert "ckpt_plugin.ActivationCheckpointing" in out and "'layrs'" in out, out  # jsonargparse's words around them
    assert FIT_DONE not in out
