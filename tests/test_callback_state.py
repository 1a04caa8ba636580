"""The callback across fits, with real Trainers: what ``setup`` checks, what a checkpoint records, what a resume says.

- ``setup`` runs the layer selection (and a segment chain's checks) before
  ``configure_optimizers``; a module that builds its layers in ``configure_model``
  is checked when fitting starts instead.
- A checkpoint records the keys the fit was trained with, the modules wrapped and
  the plugin's version, under ``callbacks["ActivationCheckpointing"]``.
- A resume with other keys warns once, naming each change; with the same keys, or
  from a checkpoint without our record, it says nothing.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckpt_plugin
from ckpt_plugin import ActivationCheckpointing, ConfigError, apply_checkpointing

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(pl.LightningModule):
    """Four Blocks built in ``__init__``; records whether ``configure_optimizers`` ran."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizers_configured = False
        self.build()

    def build(self) -> None:
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizers_configured = True
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LateNet(Net):
    """The same layers, built in ``configure_model`` (as under FSDP or meta-device init)."""

    def build(self) -> None:
        pass

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            super().build()


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, WIDTH, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


def fit(callback: ActivationCheckpointing, model: Net, tmp_path: Path, max_steps: int = 2, ckpt_path: Path | None = None
        ) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback], default_root_dir=tmp_path,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def error_of(model: nn.Module, **ckpt_keys) -> str:
    """The message ``apply_checkpointing`` raises for ``ckpt_keys`` on ``model``, outside any Trainer."""
    with pytest.raises(ConfigError) as raised:
        apply_checkpointing(model, **ckpt_keys)
    return str(raised.value)


# ---------------------------------------------------------------------------------------- checked at setup


def test_a_misspelt_layer_fails_before_configure_optimizers(tmp_path: Path) -> None:
    expected = error_of(Net(), layers="Blok")  # the selection's own message, whatever its hints say
    assert expected.startswith("ckpt.layers: no module of class 'Blok' in Net")
    model = Net()
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        fit(ActivationCheckpointing(layers="Blok"), model, tmp_path)
    assert not model.optimizers_configured


def test_more_segments_than_layers_fail_before_configure_optimizers(tmp_path: Path) -> None:
    expected = error_of(Net(), layers="Block", segments=5)
    assert expected.startswith("ckpt.segments=5 ")
    model = Net()
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        fit(ActivationCheckpointing(layers="Block", segments=5), model, tmp_path)
    assert not model.optimizers_configured


def test_auto_checks_its_layers_at_setup_without_profiling(tmp_path: Path) -> None:
    model = Net()
    with pytest.raises(ConfigError, match=f"^{re.escape(error_of(Net(), layers='Blok'))}$"):
        fit(ActivationCheckpointing(mode="auto", layers="Blok", budget=0.5), model, tmp_path)
    assert not model.optimizers_configured


def test_layers_built_in_configure_model_are_checked_when_fitting_starts(tmp_path: Path) -> None:
    callback = ActivationCheckpointing(layers="Block")
    fit(callback, LateNet(), tmp_path)
    assert callback.wrapped == BLOCKS
    # Nothing matches in setup (no blocks yet): the check waits for on_fit_start, after configure_optimizers.
    built = LateNet()
    built.configure_model()
    model = LateNet()
    with pytest.raises(ConfigError, match=f"^{re.escape(error_of(built, layers='Blok'))}$"):
        fit(ActivationCheckpointing(layers="Blok"), model, tmp_path)
    assert model.optimizers_configured


# ---------------------------------------------------------------------------------------- the checkpoint's record


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of two steps with ``layers=Block``."""
    tmp = tmp_path_factory.mktemp("saved")
    trainer = fit(ActivationCheckpointing(layers="Block"), Net(), tmp)
    trainer.save_checkpoint(tmp / "two_steps.ckpt")
    return tmp / "two_steps.ckpt"


def test_the_checkpoint_records_the_keys_and_what_was_wrapped(saved: Path) -> None:
    checkpoint = torch.load(saved, weights_only=True)  # plain Python: loads without unpickling our classes
    assert checkpoint["callbacks"] == {"ActivationCheckpointing": {
        "config": {"layers": ["Block"], "every_n": 1, "sample": "step", "mode": "full", "preserve_rng_state": True,
                   "check_recompute": False, "segments": None, "budget": None, "offload": False, "deepspeed": None,
                   "compile": False},
        "wrapped": BLOCKS,
        "version": ckpt_plugin.__version__,
    }}


def _resume(callback: ActivationCheckpointing, saved: Path, tmp_path: Path) -> list[str]:
    """Resume ``saved`` for one more step; the messages of every warning raised that names the callback."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(callback, Net(), tmp_path, max_steps=3, ckpt_path=saved)
    assert trainer.global_step == 3
    return [str(w.message) for w in caught if "ActivationCheckpointing" in str(w.message)]


def test_resuming_with_the_same_keys_says_nothing(saved: Path, tmp_path: Path) -> None:
    callback = ActivationCheckpointing(mode="full", layers=["Block"], every_n=1)  # the same keys, written otherwise
    assert _resume(callback, saved, tmp_path) == []
    assert callback.wrapped == BLOCKS


def test_resuming_with_other_keys_warns_once_naming_each_change(saved: Path, tmp_path: Path) -> None:
    callback = ActivationCheckpointing(layers="blocks.*", every_n=2)
    assert _resume(callback, saved, tmp_path) == [
        "ActivationCheckpointing: this run's ckpt config differs from the checkpoint's: layers 'Block' -> 'blocks.*', "
        "every_n 1 -> 2. Training resumes with this run's config (activation checkpointing does not change the "
        "weights, only memory and time)."
    ]
    assert callback.wrapped == ["blocks.1", "blocks.3"]  # this run's keys


def test_a_checkpoint_without_our_record_resumes_silently(saved: Path, tmp_path: Path) -> None:
    # What 0.1.0 and earlier wrote: state_dict() was {}, which Lightning does not store at all.
    checkpoint = torch.load(saved, weights_only=True)
    del checkpoint["callbacks"]["ActivationCheckpointing"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    callback = ActivationCheckpointing(layers="Block", every_n=2)
    assert _resume(callback, tmp_path / "old.ckpt", tmp_path) == []
    assert callback.wrapped == ["blocks.1", "blocks.3"]


def test_a_mode_change_names_the_mode_and_the_keys_it_brings() -> None:
    callback = ActivationCheckpointing(mode="selective", layers="Block")
    state = ActivationCheckpointing(layers="Block").state_dict()
    with pytest.warns(UserWarning) as record:
        callback.load_state_dict(state)
    assert [str(w.message) for w in record] == [
        "ActivationCheckpointing: this run's ckpt config differs from the checkpoint's: mode 'full' -> 'selective', "
        "policy (unset) -> 'matmuls'. Training resumes with this run's config (activation checkpointing does not "
        "change the weights, only memory and time)."
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.load_state_dict({})  # a record without keys (another version's): nothing to compare
        callback.load_state_dict({"wrapped": BLOCKS})


@pytest.mark.parametrize("keys", [{"mode": "full"}, {"mode": "auto", "budget": 0.5}])
def test_a_record_from_before_a_key_existed_reads_as_that_keys_default(keys) -> None:
    """A checkpoint written before ckpt.compile and ckpt.timing (and full's budget) existed: no change to name."""
    callback = ActivationCheckpointing(layers="Block", **keys)
    state = callback.state_dict()
    for key in ("compile", "timing", "budget" if keys["mode"] == "full" else "compile"):
        state["config"].pop(key, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.load_state_dict(state)
    state["config"]["compile"] = "aot_eager"  # and one that differs is still named
    with pytest.warns(UserWarning, match=r"compile 'aot_eager' -> False"):
        callback.load_state_dict(state)
