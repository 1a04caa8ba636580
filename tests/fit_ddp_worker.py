"""Two DDP ranks (gloo on CPU) fitting ``ckpt.memory`` with ``ckpt.batch=max``, for tests/test_fit_memory.py.

    python tests/fit_ddp_worker.py OUT_DIR

Rank 0 plans the batch and the plan; every rank sets the batch, installs the plan and measures its own whole
step at the second batch. Each rank writes ``OUT_DIR/rank<r>.json``: the batch set, the batch sizes it trained
on, the plan installed, the whole step predicted and measured.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from ckpt_examples.data import TextData
from ckpt_examples.gpt import GPT
from ckpt_plugin import ActivationCheckpointing

LIMIT = 3 * 2**20


class Sizes(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(batch[0].shape[0])


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_embd=32, n_head=2, block_size=32, batch_size=4, dropout=0.0)
    data = TextData(block_size=32, batch_size=4, num_samples=512)
    callback = ActivationCheckpointing(mode="auto", layers="TransformerBlock", memory=LIMIT, batch="max")
    sizes = Sizes()
    trainer = pl.Trainer(max_steps=3, callbacks=[callback, sizes], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=2,
                         strategy="ddp", default_root_dir=out)
    trainer.fit(model, data)
    rank = trainer.global_rank
    watch = callback.step_watch
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world_size": trainer.world_size, "batch": callback.batch_size, "data_batch": data.batch_size,
        "seen": sizes.seen, "wrapped": callback.wrapped, "predicted": watch.predicted.peak,
        "measured": watch.measured.peak, "limit": LIMIT,
    }))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    os.chdir(target)
    main(target)
