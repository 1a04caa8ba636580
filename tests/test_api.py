"""The Python API: apply/remove, applying twice, names that stay, checkpoints that cross."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import ROOT, gpt_batch, small_gpt
from torch.utils.data import DataLoader, TensorDataset

from ckpt_plugin import ActivationCheckpointing, apply_checkpointing, remove_checkpointing, wrapped_modules
from ckpt_examples.gpt import GPT, TransformerBlock
from ckpt_plugin.engine.wrap import CheckpointedForward


def test_apply_returns_the_wrapped_names_in_model_order() -> None:
    model = small_gpt()
    names = apply_checkpointing(model, layers="TransformerBlock")
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert wrapped_modules(model) == names
    assert all(isinstance(model.blocks[i].__dict__["forward"], CheckpointedForward) for i in range(4))


def test_nested_matches_wrap_only_the_outermost() -> None:
    model = small_gpt()
    assert apply_checkpointing(model, layers=["TransformerBlock", "CausalSelfAttention"]) == [
        "blocks.0", "blocks.1", "blocks.2", "blocks.3",
    ]


def test_applying_twice_never_wraps_twice() -> None:
    model = small_gpt()
    first = apply_checkpointing(model, layers="TransformerBlock")
    wrapper = model.blocks[0].__dict__["forward"]
    assert apply_checkpointing(model, layers="TransformerBlock") == first
    inner = model.blocks[0].__dict__["forward"].inner
    # The new wrapper calls the class's forward, not the previous wrapper.
    assert inner.__func__ is TransformerBlock.forward and inner is not wrapper
    # A different config replaces the previous one.
    assert apply_checkpointing(model, layers="TransformerBlock", every_n=2) == ["blocks.1", "blocks.3"]
    assert wrapped_modules(model) == ["blocks.1", "blocks.3"]


def test_remove_restores_the_model_exactly() -> None:
    model = small_gpt()
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    apply_checkpointing(model, layers="TransformerBlock")
    assert remove_checkpointing(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    after = {n: dict(m.__dict__) for n, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys(), name
    assert remove_checkpointing(model) == []  # idempotent


def test_remove_puts_back_a_forward_someone_else_set() -> None:
    model = small_gpt()
    custom = model.blocks[0].forward  # e.g. another library's instance-level forward
    model.blocks[0].forward = custom
    apply_checkpointing(model, layers="TransformerBlock")
    assert model.blocks[0].__dict__["forward"].inner is custom
    remove_checkpointing(model)
    assert model.blocks[0].__dict__["forward"] is custom
    assert "forward" not in model.blocks[1].__dict__


def test_mode_none_unwraps() -> None:
    model = small_gpt()
    apply_checkpointing(model, layers="TransformerBlock")
    assert apply_checkpointing(model, mode="none") == []
    assert wrapped_modules(model) == []


def test_state_dict_and_parameter_names_unchanged() -> None:
    model = small_gpt()
    keys = list(model.state_dict().keys())
    params = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    apply_checkpointing(model, layers=["TransformerBlock", "Linear"])
    assert list(model.state_dict().keys()) == keys
    assert [n for n, _ in model.named_parameters()] == params
    assert [n for n, _ in model.named_modules()] == modules
    # A state_dict saved wrapped loads strictly into a plain model and back.
    plain = small_gpt(seed=1)
    plain.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(plain.state_dict(), strict=True)


def test_wrapped_model_still_gives_the_same_output() -> None:
    model = small_gpt(dropout=0.0).eval()
    x, _ = gpt_batch(model)
    expected = model(x)
    apply_checkpointing(model, layers="TransformerBlock")
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def _trainer(tmp_path: Path, callbacks: list, max_steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks, default_root_dir=tmp_path,
    )


def _loader(model: GPT) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    T, V = model.hparams.block_size, model.hparams.vocab_size
    data = torch.randint(V, (8, T + 1), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2)


def test_lightning_checkpoints_cross_between_plugin_and_plain(tmp_path: Path) -> None:
    # Saved with the plugin, loaded without it.
    model = small_gpt()
    trainer = _trainer(tmp_path, [ActivationCheckpointing(layers="TransformerBlock")], max_steps=2)
    trainer.fit(model, _loader(model))
    trainer.save_checkpoint(tmp_path / "with.ckpt")
    plain = GPT.load_from_checkpoint(tmp_path / "with.ckpt")
    assert wrapped_modules(plain) == []
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), plain.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2)

    # Saved without it, resumed with it: training goes on from the same state.
    model = small_gpt()
    trainer = _trainer(tmp_path, [], max_steps=2)
    trainer.fit(model, _loader(model))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    resumed = small_gpt(seed=5)
    callback = ActivationCheckpointing(layers="TransformerBlock")
    trainer = _trainer(tmp_path, [callback], max_steps=3)
    trainer.fit(resumed, _loader(resumed), ckpt_path=tmp_path / "plain.ckpt")
    assert trainer.global_step == 3
    assert callback.wrapped == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert wrapped_modules(resumed) == []  # teardown unwrapped


def test_callback_reports_what_it_saved(tmp_path: Path) -> None:
    model = small_gpt()
    callback = ActivationCheckpointing(layers="TransformerBlock")
    _trainer(tmp_path, [callback], max_steps=1).fit(model, _loader(model))
    report = callback.report
    assert report is not None and report.wrapped == callback.wrapped
    B, T, C = 2, 16, 32  # small_gpt's example_input_array and width
    for name in report.wrapped:
        assert report.with_ckpt.by_owner[name] == B * T * C * 4  # the block's float32 input
        assert report.without.by_owner[name] > 10 * B * T * C * 4
    assert report.with_ckpt.total < report.without.total
    assert "Activation checkpointing wrapped 4 module(s) of GPT" in str(report)


def test_callback_logs_saved_bytes_each_logged_step(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    model = small_gpt()
    callback = ActivationCheckpointing(layers="TransformerBlock")
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[callback], logger=CSVLogger(tmp_path), default_root_dir=tmp_path,
    )
    trainer.fit(model, _loader(model))
    metrics = trainer.logged_metrics
    # A training step keeps the block inputs and what lies outside the blocks (incl. the loss's).
    B, T, C = 2, 16, 32
    saved = metrics["ckpt/saved_activation_bytes"].item()
    assert 4 * B * T * C * 4 < saved < callback.report.without.total
    assert metrics["ckpt/bytes_saved_by_checkpointing"].item() == callback.report.without.total - callback.report.with_ckpt.total
    rows = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    assert rows[0].count("ckpt/saved_activation_bytes") == 1 and len(rows) == 3  # header + one row per step


def test_typed_package_with_its_version() -> None:
    """PEP 561's marker ships in the package, and ``__version__`` is pyproject.toml's version."""
    import importlib.resources
    import tomllib

    import ckpt_plugin

    assert importlib.resources.files("ckpt_plugin").joinpath("py.typed").is_file()
    assert ckpt_plugin.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_is_the_installed_one() -> None:
    """``__version__`` is the version pip installed (a stale install shows here)."""
    import importlib.metadata

    import ckpt_plugin

    try:
        installed = importlib.metadata.version("ckpt-plugin")
    except importlib.metadata.PackageNotFoundError:
        # The GPU check's machines run the checkout from PYTHONPATH, not installed (docs/gpu.md)
        pytest.skip("ckpt-plugin is not installed (no package metadata): no installed version to compare")
    assert ckpt_plugin.__version__ == installed
