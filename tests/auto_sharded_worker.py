"""ckpt=auto under the sharded strategies: two ranks (gloo on CPU), for tests/test_auto_sharded.py.

    python tests/auto_sharded_worker.py OUT_DIR '{"fsdp": ["fsdp", {"mode": "auto", "budget": 0.5}]}'

Each run fits the example GPT (SGD, so equal parameters after a step mean equal
gradients) for one step under the named strategy with the given ckpt keys, or
without the callback where the keys are null. Each rank writes
``OUT_DIR/<run>/rank<r>.json`` (what it installed, or the error it raised) and
``OUT_DIR/<run>/rank<r>.pt`` (the full parameters after the step). Errors are recorded, and the next
run goes on in the same two processes (a ConfigError in setup is raised on every rank alike).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckpt_examples.gpt import GPT
from ckpt_examples.sharding import shard_blocks
from ckpt_plugin import ActivationCheckpointing
from ckpt_plugin.engine.wrap import CheckpointedForward

SIZE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1, batch_size=2)


class SGDGPT(GPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class TensorParallelGPT(SGDGPT):
    """Each block's MLP tensor parallel (its first linear by columns, its second by rows), then FSDP2 over the data
    parallel dimension, as torchtitan lays out a model on a 2-D mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if isinstance(self, FSDPModule):
            return
        for block in self.blocks:
            parallelize_module(block.mlp, self.device_mesh["tensor_parallel"],
                               {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        shard_blocks(self, self.blocks, self.device_mesh)


def model(strategy: str) -> GPT:
    torch.manual_seed(7)
    if strategy == "tensor_parallel":
        return TensorParallelGPT(**SIZE)
    if strategy == "fsdp2_meta":  # as trainer.init_module(empty_init=True) builds it under ModelParallelStrategy
        with torch.device("meta"):
            return SGDGPT(**SIZE)
    return SGDGPT(**SIZE, defer_init=strategy == "model_parallel")  # "fsdp2": FSDP2 too, the layers built in __init__


def data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(96, (4, SIZE["block_size"]), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=2)


def strategy_of(name: str) -> Any:
    from cpu_strategies import CPUDeepSpeedStrategy, CPUFSDPStrategy

    if name == "fsdp":  # one root unit: a wrap policy per block renames the blocks (blocks.0._fsdp_wrapped_module)
        return CPUFSDPStrategy()
    if name in ("model_parallel", "fsdp2", "fsdp2_meta", "tensor_parallel"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        tp = 2 if name == "tensor_parallel" else 1
        return ModelParallelStrategy(data_parallel_size=2 // tp, tensor_parallel_size=tp, process_group_backend="gloo")
    if name == "cuda_deepspeed_zero3_offload":  # one GPU (the GPU check): Lightning's deepspeed_stage_3_offload
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
        strategy.config["zero_force_ds_cpu_optimizer"] = False  # SGD steps the host copy: no CPU Adam op to build
        return strategy
    if name.startswith("deepspeed_zero"):  # deepspeed_zero3_bf16: its precision, the Trainer's (fit)
        # _buckets: reduce buffers of 1e4 elements (Lightning's default, 2e8, is 1.6 GB of them with overlap_comm)
        buckets = dict(reduce_bucket_size=10_000, allgather_bucket_size=10_000) if "_buckets" in name else {}
        # _offload: Lightning's deepspeed_stage_3_offload (optimizer and parameters to cpu); a torch optimizer steps
        # the host copy (DeepSpeed's CPU Adam needs an op built)
        offload = dict(offload_optimizer=True, offload_parameters=True) if "_offload" in name else {}
        strategy = CPUDeepSpeedStrategy(stage=int(name.removeprefix("deepspeed_zero")[0]), **buckets, **offload)
        if offload:
            strategy.config["zero_force_ds_cpu_optimizer"] = False
        if name.startswith("deepspeed_zero3_buckets"):  # ZeRO-3 at this model's scale: the norms and biases kept
            # whole, the rest gathered a bucket's worth ahead and released unless used again within one
            strategy.config["zero_optimization"].update(
                stage3_prefetch_bucket_size=10_000, stage3_param_persistence_threshold=200,
                stage3_max_reuse_distance=10_000)
        return strategy
    return name


class Seeded(pl.Callback):
    """The same dropout masks in every run: seeded after ckpt=auto has planned (its timing draws numbers)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.manual_seed(100 + trainer.global_rank)


def full_parameters(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor]:
    strategy = trainer.strategy
    name = type(strategy).__name__
    if "FSDPStrategy" in name:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(strategy.model, writeback=False):
            return {n: p.detach().clone() for n, p in module.named_parameters()}
    if "DeepSpeed" in name:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {n: p.detach().clone() for n, p in module.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


class _Said(logging.Handler):
    """Counts the log records that start with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start, self.count = start, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith(self.start)


def fit(strategy: str, keys: dict[str, Any] | None, out: Path) -> pl.Trainer:
    net = model(strategy)
    callbacks: list[pl.Callback] = [Seeded()]
    callback = None
    if keys is not None:
        callback = ActivationCheckpointing(layers="TransformerBlock", **keys)
        callbacks.insert(0, callback)
    precision = "bf16-mixed" if strategy.endswith("_bf16") else "32-true"
    cuda = strategy.startswith("cuda_")
    trainer = pl.Trainer(accelerator="cuda" if cuda else "cpu", devices=1 if cuda else 2,
                         strategy=strategy_of(strategy), logger=False,
                         max_steps=2 if keys and "memory" in keys else 1,  # ckpt.memory's check: the second step
                         precision=precision,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, default_root_dir=out)
    installed: dict[str, str] = {}

    def record() -> None:  # after on_fit_start
        for name, m in net.named_modules():
            if isinstance(m.__dict__.get("forward"), CheckpointedForward):
                t = m.__dict__["forward"].treatment
                installed[name] = f"checkpointing={t.checkpointing} policy={t.policy!r}"

    net.on_train_start = record
    result: dict[str, Any] = {}
    said = _Said("ckpt: measuring runs")  # what the measurements run, said once a fit
    logging.getLogger("lightning.pytorch").addHandler(said)
    try:
        trainer.fit(net, data())
    except Exception as err:  # the test asserts on it
        result["error"] = [type(err).__name__, str(err)]
        if not isinstance(err, ValueError):  # a ConfigError is what a test expects; anything else, in full
            traceback.print_exc()
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(said)
    result["measuring_said"] = said.count
    rank = trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    if "error" not in result:
        result.update(installed=installed, wrapped=callback.wrapped if callback else [],
                      choices={n: str(o) for n, o in callback.planned.choices.items()}  # options by their names
                      if callback and callback.planned else None,
                      plan=callback.state_dict().get("plan") if callback else None,
                      plan_path=str(callback.plan_path) if callback and callback.plan_path else None)
        watch = callback.step_watch if callback else None
        if watch is not None and watch.measured is not None:  # ckpt.memory: the second step, predicted and measured
            result.update(limit=watch.limit, predicted=watch.predicted.peak, measured=watch.measured.peak,
                          split=str(watch.measured), predicted_split=str(watch.predicted),
                          peaks=watch.measured.peaks, cuda_peak=watch.cuda_peak,
                          offloaded=[s.offloaded.bytes if s.offloaded else 0 for s in (watch.predicted, watch.measured)])
        torch.save(full_parameters(trainer, net), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return trainer


def main(out: Path, runs: dict[str, list]) -> None:
    from rank_exit import leave  # beside this file

    children: list = []
    for name, (strategy, keys) in runs.items():
        start = time.perf_counter()
        trainer = fit(strategy, keys, out / name)
        children += getattr(trainer.strategy.launcher, "procs", None) or []
        print(f"[auto_sharded_worker] rank {trainer.global_rank} {name}: {time.perf_counter() - start:.1f} s",
              flush=True)
    leave(trainer.global_rank, children)


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), str(Path(__file__).resolve().parents[1])]
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
