"""DeepSpeed ZeRO for ``python -m ckpt_tools.fit_fsdp --strategy deepspeed_stage_N`` (N = 1, 2, 3): rank 0's
prediction (the module's step on fake tensors, modelled as a rank's: ``ckpt_plugin/apply/zero.py``) and every
rank's real step (a DeepSpeed engine over gloo on the CPU, its second step measured with MemTracker, DeepSpeed's
own tensors followed as the callback follows them).

The config is the one the model's terms read: fp32, ``contiguous_gradients`` and ``overlap_comm`` on (Lightning's
defaults), ``reduce_bucket_size`` :data:`BUCKET` elements (Lightning's default, 2e8, would be 1.6 GB of buffers
on every rank whatever the model).
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_plugin._compat import CategoryPeakTracker, seen_bytes
from ckpt_plugin.apply.batch import Sample
from ckpt_plugin.apply.install import install_plan
from ckpt_plugin.apply.zero import Zero, Zero3, ZeroSteps, rank_steps
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.lightning.zero import stand_in, tracked
from ckpt_plugin.measure.sample import scalar
from ckpt_plugin.measure.whole_step import Held, StepSplit, split_of

BUCKET = 50_000  # reduce_bucket_size and allgather_bucket_size, elements (400 KB of buffers with overlap_comm)
STAGES = {"deepspeed_stage_1": 1, "deepspeed_stage_2": 2, "deepspeed_stage_3": 3, "deepspeed_stage_3_offload": 3,
          # bf16 (DeepSpeed's "bf16" section: the module cast, a float32 master copy; the batch cast as Lightning's
          # precision converts it)
          "deepspeed_stage_1_bf16": 1, "deepspeed_stage_2_bf16": 2, "deepspeed_stage_3_bf16": 3}
# Lightning's deepspeed_stage_3_offload: the optimizer (master copy, gradients' partitions, state) and the parameters'
# partitions in host memory. On the CPU the host is the device: the offloaded bytes stay in the step. A torch
# optimizer steps the host copy (DeepSpeed's own CPU Adam needs an op built: zero_force_ds_cpu_optimizer off).
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
# ZeRO-3's, sized to the models' scale as BUCKET is: prefetch a bucket's worth, keep whole only parameters of at
# most PERSIST elements (norms, biases), release what is not used again within a bucket's worth of the trace
# (DeepSpeed's default, 1e9, keeps every parameter of these models whole from its first use to its backward).
PERSIST = 1_000
STAGE3 = {"stage3_prefetch_bucket_size": BUCKET, "stage3_param_persistence_threshold": PERSIST,
          "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": BUCKET}


def dtype_of(strategy: str) -> torch.dtype:
    return torch.bfloat16 if strategy.endswith("_bf16") else torch.float32


def zero_of(strategy: str) -> Zero | Zero3:
    if STAGES[strategy] == 3:
        offload = strategy.endswith("_offload")
        return Zero3(world=dist.get_world_size(), reduce_bucket_size=BUCKET, prefetch_bucket_size=BUCKET,
                     max_live_parameters=STAGE3["stage3_max_live_parameters"],
                     max_reuse_distance=STAGE3["stage3_max_reuse_distance"], param_persistence_threshold=PERSIST,
                     offload_optimizer=offload, offload_param=offload, host_is_device=True,
                     dtype=dtype_of(strategy))
    return Zero(stage=STAGES[strategy], world=dist.get_world_size(), reduce_bucket_size=BUCKET, overlap_comm=True,
                dtype=dtype_of(strategy))


def predicted_steps(strategy: str, model: nn.Module, sample: Sample,
                    make: Callable[[Any], torch.optim.Optimizer]) -> ZeroSteps:
    """Rank 0's: the module's whole step on fake tensors (``make`` its optimizer), as a ZeRO rank's."""
    optimizer = stand_in(make(model.parameters()))  # DeepSpeed's CPU Adam: torch's, its state (lightning/zero.py)
    sample = sample.cast(dtype_of(strategy))
    return rank_steps(model, sample.loss, [optimizer], lambda rows: (sample.held(rows),), zero_of(strategy))


def _engine(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str) -> tuple[Any, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank = dist.get_rank()  # what DeepSpeed's launcher would have set: one process per rank on this machine
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()))
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as tests/cpu_strategies.py: not needed
    deepspeed.init_distributed("gloo")  # the default group is up already: DeepSpeed's comm wraps it
    zero = {"stage": STAGES[strategy], "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
            "overlap_comm": True, "contiguous_gradients": True, **(STAGE3 if STAGES[strategy] == 3 else {}),
            **(OFFLOAD if strategy.endswith("_offload") else {})}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 2**31 - 1, "zero_force_ds_cpu_optimizer": False,
              **({"bf16": {"enabled": True}} if strategy.endswith("_bf16") else {})}
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=rank),  # CPU devices have no index (as tests/cpu_strategies.py)
        model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine, ds_optimizer


def real_step(strategy: str, make_sample: Callable[[nn.Module], Sample], pristine: nn.Module, plan: WrapPlan,
              make: Callable[[Any], torch.optim.Optimizer], batch: int | None = None) -> StepSplit:
    """This rank's real whole step: a copy of ``pristine`` with ``plan`` installed, in a DeepSpeed engine, at
    ``batch`` rows (None: the sample's); its second step, as Lightning runs one (forward, then DeepSpeed's
    backward and step)."""
    model = copy.deepcopy(pristine)
    with cache_warnings_silenced():
        install_plan(model, plan)
    sample = make_sample(model).cast(dtype_of(strategy))
    engine, ds_optimizer = _engine(model, make(model.parameters()), strategy)
    loss_of, batch_of = sample.loss_and_batch(batch)

    def step() -> None:
        loss = scalar(loss_of())
        engine.backward(loss)
        del loss
        engine.step()

    step()
    tracker = CategoryPeakTracker()
    tracker.track_external(model, *tracked([ds_optimizer]))
    with tracker:
        step()
    held = sample.held(batch)  # less what MemTracker counted of it (ZeRO-3's hooks detach each module's inputs)
    seen = seen_bytes(tracker, batch_of()) if STAGES[strategy] == 3 else 0
    return split_of(tracker).holding((Held(held.bytes - seen, held.by),))


__all__ = ["BUCKET", "STAGES", "predicted_steps", "real_step", "zero_of"]
