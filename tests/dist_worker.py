"""2-process training runs (gloo on CPU), one trainer preset each, for tests/test_strategies.py.

    python tests/dist_worker.py OUT_DIR '{"ddp": ["ddp", []], "zero3": ["deepspeed_zero3", ["ckpt=deepspeed"]]}'

The JSON maps a run's name to its preset and Hydra overrides. Each run composes
``train.yaml`` with ``trainer=<preset>`` as ``recipes/train.py`` does (real
Hydra, real Trainer), but fits a
:class:`Pair`: two copies of the example GPT with the same weights, seeing the
same batches and the same dropout masks, of which the plugin checkpoints only
the second (``ckpt.layers='ckpt.blocks.*'``). Within one run, under one
strategy, every difference between the copies is the plugin's. Each rank
writes ``OUT_DIR/<run>/rank<r>.json``: per step, both losses and the largest
difference between the copies' parameters after the optimizer step (gathered
in full under FSDP, FSDP2 and ZeRO-3), how many times each copy's attention
ran (a checkpointed block runs it twice), and under ZeRO-3 how many parameter
elements this rank holds.

The runs go one after another in the same two processes: importing torch,
Lightning and DeepSpeed takes each interpreter ~4 s, longer than a 4-step fit
of this model. The test starts both ranks as torchrun would (``warm_python.run_ranks``:
``LOCAL_RANK`` and one ``MASTER_PORT``), so every Trainer finds the processes made
outside, and from the second fit the process group initialised, and uses both as
they are (Lightning's own launcher is exercised by the recipe's DDP runs and
tests/test_fabric.py). Each run builds its own
Trainer, callbacks, data and :class:`Pair`, and ``train`` seeds it afresh.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.utilities import rank_zero_info

from ckpt_examples.gpt import GPT
from ckpt_examples.sharding import shard_blocks
from ckpt_plugin import ActivationCheckpointing

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "recipes" / "configs")
CPU_TARGETS = {  # Lightning refuses these strategies on CPU; test-only subclasses (cpu_strategies.py)
    "fsdp": "cpu_strategies.CPUFSDPStrategy",
    "deepspeed_zero1": "cpu_strategies.CPUDeepSpeedStrategy",
    "deepspeed_zero2": "cpu_strategies.CPUDeepSpeedStrategy",
    "deepspeed_zero3": "cpu_strategies.CPUDeepSpeedStrategy",
}
SIZE = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.1, batch_size=4)


class Pair(pl.LightningModule):
    """Two GPTs with the same weights, built in ``configure_model`` (under ZeRO-3's ``zero.Init``)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[tuple[float, float]] = []
        self.param_diffs: list[float] = []
        self.attn_calls = {"plain": 0, "ckpt": 0}
        self.local_elements: list[tuple[int, int]] = []

    def configure_model(self) -> None:
        if hasattr(self, "plain"):
            return
        for name in ("plain", "ckpt"):
            torch.manual_seed(7)  # the same initial weights in both copies
            setattr(self, name, GPT(**SIZE))
            for block in getattr(self, name).blocks:
                block.attn.register_forward_hook(lambda *_, name=name: self._count(name))
        if self.device_mesh is not None:  # ModelParallelStrategy: FSDP2, block by block, then the pair
            shard_blocks(self.plain, self.plain.blocks, self.device_mesh)
            shard_blocks(self.ckpt, self.ckpt.blocks, self.device_mesh)
            shard_blocks(self, torch.nn.ModuleList(), self.device_mesh)

    def _count(self, name: str) -> None:
        self.attn_calls[name] += 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        params = [p for p in self.parameters() if hasattr(p, "ds_numel")]
        if params:  # ZeRO-3: what this rank holds between steps, against the full sizes
            self.local_elements.append((sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)))
        rng = torch.get_rng_state()
        loss_plain = self.plain.loss(batch)
        torch.set_rng_state(rng)  # the same dropout masks in the second copy
        loss_ckpt = self.ckpt.loss(batch)
        self.losses.append((loss_plain.item(), loss_ckpt.item()))
        return loss_plain + loss_ckpt

    def on_train_batch_end(self, *args: Any) -> None:
        with full_parameters(self.trainer.strategy, self):
            plain = [p.detach().clone() for p in _full(self.plain.parameters())]
            ckpt = [p.detach().clone() for p in _full(self.ckpt.parameters())]
        self.param_diffs.append(max((a - b).abs().max().item() for a, b in zip(plain, ckpt, strict=True)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Plain SGD: a parameter after the step is p - lr * grad, so equal parameters mean equal gradients.
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _full(params: Any) -> list[torch.Tensor]:
    """FSDP2's DTensors gathered in full (a collective: every rank calls it); others as they are."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]


@contextmanager
def full_parameters(strategy: Any, module: torch.nn.Module):
    """Every parameter of ``module`` in full on every rank, for the duration."""
    name = type(strategy).__name__
    if "FSDPStrategy" in name:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(strategy.model, writeback=False):
            yield
    elif "DeepSpeed" in name and strategy.zero_stage_3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield
    else:
        yield


def _deepspeed_checkpointing() -> dict[str, Any] | None:
    """How ``deepspeed.checkpointing`` ended up configured (its module globals), if DeepSpeed ran."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds

    names = ("PARTITION_ACTIVATIONS", "CPU_CHECKPOINT", "CONTIGUOUS_CHECKPOINTING", "num_layers", "SYNCHRONIZE",
             "PROFILE_TIME")
    return {name: getattr(ds, name) for name in names}


def fit(preset: str, overrides: list[str], out: Path) -> pl.Trainer:
    """One run: ``OUT/rank<r>.json`` on each rank."""
    target = [f"trainer.strategy._target_={CPU_TARGETS[preset]}"] if preset in CPU_TARGETS else []
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("train", overrides=[
            f"trainer={preset}", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=4",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
            "ckpt.layers=ckpt.blocks.*", f"data.block_size={SIZE['block_size']}",
            f"data.batch_size={SIZE['batch_size']}", *target, *overrides,
        ])
    from recipes.train import train  # after __main__ has put the checkout on sys.path

    model = Pair()
    trainer = train(cfg, model=model)  # the recipe itself, fitting the pair instead of cfg.model
    callback = next(c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing))
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size, "wrapped": callback.wrapped,
        "losses": model.losses, "param_diffs": model.param_diffs, "attn_calls": model.attn_calls,
        "local_elements": model.local_elements, "global_step": trainer.global_step,
        # Read now, not at exit: a later run in this process may configure DeepSpeed's checkpoint again.
        "deepspeed_checkpointing": _deepspeed_checkpointing(),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return trainer


def main(out: Path, runs: dict[str, list]) -> None:
    from rank_exit import leave  # beside this file

    children: list = []  # the ranks Lightning's launcher started, were the script run alone (rank 0's)
    for name, (preset, overrides) in runs.items():
        start = time.perf_counter()
        trainer = fit(preset, overrides, out / name)
        children += getattr(trainer.strategy.launcher, "procs", [])
        rank_zero_info(f"[dist_worker] {name}: {time.perf_counter() - start:.1f} s")
    leave(trainer.global_rank, children)  # rank 0 fails if rank 1 did


if __name__ == "__main__":
    # A script, not a test module: pytest's pythonpath does not reach it. cpu_strategies lives
    # beside it; recipes.train at the root of the checkout.
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), str(ROOT)]
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
