"""Two FSDP ranks (Lightning's FSDPStrategy, FSDP v1; with ``"strategy": "fsdp2"`` ModelParallelStrategy, the
examples' FSDP2; gloo on CPU) fitting ``ckpt.memory``, for tests/test_fit_fsdp.py.

    python tests/fit_fsdp_worker.py OUT_DIR '[{"name": "adamw_low", "optimizer": "adamw", "memory": 3000000}]'

Each run fits the example GPT (a unit per TransformerBlock, FULL_SHARD; its sizes from ``"gpt"``) or, with
``"model": "resnet"``, the example ResNet (a unit per Bottleneck) for three steps with ``ckpt=auto``,
``ckpt.memory`` and, where the run says so, ``ckpt.batch=max`` and a ``precision``. Rank 0 plans in setup, on the
whole module, each whole step on a fake twin the strategy shards; every rank installs the plan and measures its
own whole step at the second batch; ``"plan": "<run>"`` gives that run's ``ckpt_plan.json`` back with ``ckpt.plan``.
Each rank writes ``OUT_DIR/<run>/rank<r>.json``: the plan installed, the
batch, the whole step predicted and measured (MemTracker, every category; with ``--cuda`` the allocator's peak),
or the error it raised. The runs share the two processes. ``--cuda`` (the GPU check): Lightning's own
FSDPStrategy on one GPU.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ckpt_examples.data import ImageData, TextData
from ckpt_examples.gpt import GPT, TransformerBlock
from ckpt_examples.resnet import Bottleneck, ResNet
from ckpt_plugin import ActivationCheckpointing

SIZE = dict(n_layer=4, n_embd=64, n_head=2, block_size=64, dropout=0.0)


class SGDGPT(GPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Sizes(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch[0].shape[0])


def fit(out: Path, run: dict[str, Any], cuda: bool = False) -> None:
    from cpu_strategies import CPUFSDPStrategy
    from lightning.pytorch.strategies import FSDPStrategy

    torch.manual_seed(0)
    if run.get("model") == "resnet":  # SGD with momentum, BatchNorm's buffers; a unit per Bottleneck
        model, layer = ResNet(channels=16, depths=(1, 1), image_size=16, batch_size=8, dropout=0.0), Bottleneck
        data = ImageData(image_size=16, batch_size=8, num_samples=256)
    else:
        size = {**SIZE, **run.get("gpt", {})}
        model = (SGDGPT if run["optimizer"] == "sgd" else GPT)(**size, batch_size=run.get("data_batch", 4))
        data, layer = TextData(block_size=size["block_size"], batch_size=run.get("data_batch", 4),
                               num_samples=512), TransformerBlock
    if "plan" in run:  # ckpt.plan: the file another run of this launch wrote (in its own folder)
        callback = ActivationCheckpointing(mode="auto", layers=layer.__name__,
                                           plan=str(out / run["plan"] / "ckpt_plan.json"))
    else:
        callback = ActivationCheckpointing(mode="auto", layers=layer.__name__, memory=run["memory"],
                                           batch=run.get("batch"))
    sizes = Sizes()
    # --cuda (the GPU check): Lightning's own strategies on one GPU; else two gloo ranks on the CPU.
    if run.get("strategy") == "fsdp2":  # the example's configure_model: fully_shard per block, then the whole model
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1 if cuda else 2, tensor_parallel_size=1,
                                         process_group_backend=None if cuda else "gloo")
    else:
        strategy = FSDPStrategy(auto_wrap_policy={layer}) if cuda else CPUFSDPStrategy(auto_wrap_policy={layer})
    trainer = pl.Trainer(max_steps=3, callbacks=[callback, sizes], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cuda" if cuda else "cpu",
                         devices=1 if cuda else 2, precision=run.get("precision", "32-true"), strategy=strategy,
                         default_root_dir=out / run["name"])
    where = out / run["name"]
    where.mkdir(parents=True, exist_ok=True)
    try:
        trainer.fit(model, data)
    except Exception as err:  # recorded; the next run goes on in the same two processes
        record = {"error": [type(err).__name__, str(err)], "trace": traceback.format_exc()[-3000:]}
    else:
        watch = callback.step_watch  # None for a given plan: nothing was predicted
        record = {"world_size": trainer.world_size, "wrapped": callback.wrapped, "batch": callback.batch_size,
                  "seen": sizes.seen, "plan_path": str(callback.plan_path) if callback.plan_path else None}
        if watch is not None:
            record |= {"predicted": watch.predicted.peak, "measured": watch.measured.peak,
                       "predicted_at_peak": watch.predicted.at_peak, "measured_at_peak": watch.measured.at_peak,
                       "limit": watch.limit, "cuda_peak": watch.cuda_peak}
    (where / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    os.chdir(target)
    sys.path.insert(0, str(Path(__file__).parent))
    for run in json.loads(sys.argv[2]):
        fit(target, run, cuda="--cuda" in sys.argv[3:])
