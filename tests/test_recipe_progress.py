"""The recipe's progress bar reads ``Epoch 0``, not Lightning 2.6's ``Epoch 0/-2``, when steps bound the run."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from recipes.train import StepsRichProgressBar

pytest.importorskip("rich")


@pytest.mark.parametrize(("max_epochs", "want"), [(-1, "Epoch 0"), (3, "Epoch 0/2")])
def test_epoch_description(tmp_path, max_epochs: int, want: str) -> None:
    bar = StepsRichProgressBar()
    trainer = Trainer(max_epochs=max_epochs, max_steps=1, callbacks=[bar], logger=False, enable_checkpointing=False,
                      enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu", devices=1)
    trainer.fit(BoringModel())
    assert bar._get_train_description(0).strip() == want
