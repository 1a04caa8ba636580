"""``ckpt.memory`` and ``ckpt.batch=max`` under Lightning's ``DeepSpeedStrategy``, ZeRO-1, 2 and 3: the rank's
whole step modelled from the module's own (``apply/zero.py``; ZeRO-3's gathering played on it:
``apply/zero3_gather.py``), the terms read from the strategy's DeepSpeed config.

ZeRO-3's offload to host memory (``offload_optimizer``, ``offload_param``: device ``cpu``) is modelled: on a GPU
what is offloaded leaves the device's step, on the CPU (the host is the device) it stays in it.

What is not modelled yet is refused on every rank in ``setup``, naming the key: offload under ZeRO-1/2, to NVMe, or
of part of the optimizer (``ratio``); ``contiguous_gradients=false`` (gradients that stay whole until their bucket
is reduced), a precision other than 32-bit and bf16 (fp16's loss scaling), and under bf16 gradients accumulated or
communicated in another dtype than the module's. Under bf16 the fake step runs on the module's parameters cast as
DeepSpeed casts them (``apply/zero.cast``) and the batch as Lightning's precision converts it; the optimizer steps
float32 partitions, as DeepSpeed's (``measure/flat_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from ckpt_plugin.apply.batch import Sample
from ckpt_plugin.apply.zero import Zero, Zero3, ZeroSteps, rank_steps
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.measure.whole_step import Held

# DeepSpeed's own defaults where the config leaves a key out (deepspeed/runtime/zero/config.py, 0.19): Lightning's
# DeepSpeedStrategy writes every key (reduce_bucket_size 2e8, overlap_comm and contiguous_gradients on); a config
# file given to it (``config=``) may not.
_DEFAULTS = {"reduce_bucket_size": 500_000_000, "overlap_comm": False, "contiguous_gradients": True}
# ZeRO-3's keys -> the terms of apply/zero3_gather.Zero3, whose defaults are DeepSpeed's where the config has none
_ZERO3_KEYS = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
               "stage3_max_live_parameters": "max_live_parameters",
               "stage3_max_reuse_distance": "max_reuse_distance",
               "stage3_param_persistence_threshold": "param_persistence_threshold",
               "stage3_model_persistence_threshold": "model_persistence_threshold"}
# Lightning's precisions under DeepSpeed -> the dtype DeepSpeed casts the module's parameters to
_DTYPES = {"32-true": torch.float32, "32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}
_OFFLOADS = ("offload_optimizer", "offload_param")


def _offloaded(zero: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The offload sections of ``zero_optimization`` that move something (device not ``none``)."""
    return {k: dict(zero.get(k) or {}) for k in _OFFLOADS if str((zero.get(k) or {}).get("device", "none")) != "none"}


def is_deepspeed(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``DeepSpeedStrategy`` (a ``DDPStrategy`` to Lightning)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return isinstance(strategy, DeepSpeedStrategy)


def _section(strategy: Any) -> dict[str, Any]:
    return dict(strategy.config.get("zero_optimization") or {})


def zero_refused(strategy: Any, key: str, value: Any) -> ConfigError | None:
    """The error for ``key=value`` (``ckpt.memory`` or ``ckpt.batch``) under ``strategy``'s ZeRO where its whole
    step is not modelled yet, else None."""
    zero = _section(strategy)
    stage = int(zero.get("stage", 0))
    precision = str(getattr(strategy.precision_plugin, "precision", "32-true"))
    name = f"{type(strategy).__name__} (ZeRO stage {stage})"
    why, what = None, ""
    if stage not in (1, 2, 3):
        why, what = f"ZeRO stage {stage} shards nothing: plan it as DDP", "zero_optimization.stage"
    elif (offloaded := _offloaded(zero)) and stage != 3:
        why, what = (f"offload under ZeRO stage {stage} is not modelled yet (under ZeRO-3 it is)",
                     f"zero_optimization.{next(iter(offloaded))}")
    elif nvme := [k for k, v in offloaded.items() if str(v["device"]) != "cpu"]:
        device = offloaded[nvme[0]]["device"]
        why, what = f"offload to {device} is not modelled yet (to cpu it is)", f"zero_optimization.{nvme[0]}.device"
    elif float(offloaded.get("offload_optimizer", {}).get("ratio", 1.0)) != 1.0:
        why = "offloading part of the optimizer is not modelled yet (all of it is: ratio 1.0)"
        what = "zero_optimization.offload_optimizer.ratio"
    elif not zero.get("contiguous_gradients", _DEFAULTS["contiguous_gradients"]):
        why = ("with contiguous_gradients=false the gradients stay whole until their bucket is reduced: not "
               "modelled yet")
        what = "zero_optimization.contiguous_gradients"
    elif precision not in _DTYPES:
        why = f"with precision {precision} the step is not modelled yet (32-bit and bf16 are)"
        what = "trainer.precision"
    elif precision.startswith("bf16") and (given := _dtype_keys(strategy.config)):
        why, what = "gradients accumulated or communicated in another dtype than the module's: not modelled yet", given
    if why is None:
        return None
    return ConfigError([Problem(
        key,
        f"{key}={value} cannot be planned under trainer.strategy {name}: {why} ({what}); under DeepSpeed "
        "ckpt.memory and ckpt.batch=max plan ZeRO-1, ZeRO-2 and ZeRO-3 in 32-bit precision and bf16 (ZeRO-3 "
        "with offload to cpu too), their buffers from the config",
        "here plan the activations with ckpt.budget (a fraction of the activation peak without checkpointing, or "
        "min), give a plan file with ckpt.plan=<file>, or choose a fixed mode (ckpt=full, ckpt=selective, "
        "ckpt=offload)",
    )])


def _dtype_keys(config: dict[str, Any]) -> str:
    """The first key that sets the gradients' accumulation or communication dtype ("" if none does): the model
    takes DeepSpeed's defaults (both the module's dtype)."""
    if (config.get("data_types") or {}).get("grad_accum_dtype") is not None:
        return "data_types.grad_accum_dtype"
    return "communication_data_type" if config.get("communication_data_type") is not None else ""


def dtype_of(strategy: Any) -> torch.dtype:
    """The dtype DeepSpeed casts the module's parameters to under the strategy's precision (float32 unless bf16)."""
    return _DTYPES.get(str(getattr(strategy.precision_plugin, "precision", "32-true")), torch.float32)


def is_zero3(strategy: Any) -> bool:
    """Whether ``strategy`` is DeepSpeed's ZeRO-3 (its hooks gather each module's parameters, and detach its
    inputs: MemTracker then counts the batch as the step's own)."""
    return is_deepspeed(strategy) and int(_section(strategy).get("stage", 0)) == 3


def deepspeed_linear(strategy: Any) -> bool:
    """Whether the strategy's engine runs ``torch.nn.functional.linear`` as DeepSpeed's own (ZeRO-3's
    ``memory_efficient_linear``, on by default): then ckpt=auto plans without selective options
    (``planning/options.without_selective``)."""
    return is_zero3(strategy) and bool(_section(strategy).get("memory_efficient_linear", True))


def zero_steps(trainer: pl.Trainer, pl_module: pl.LightningModule, sample: Sample,
               held: tuple[Held, ...]) -> ZeroSteps:
    """The rank's whole step under ``trainer.strategy`` (ZeRO-1/2/3, refused otherwise by :func:`zero_refused`):
    the module's own step on fake tensors, its ``configure_optimizers`` stepping it, as :mod:`apply.zero` models
    the rank's."""
    from lightning.pytorch.core.optimizer import (
        _init_optimizers_and_lr_schedulers,  # private to Lightning: configure_optimizers, as the Trainer reads it
    )

    section = _section(trainer.strategy)
    dtype = dtype_of(trainer.strategy)
    sample = sample.cast(dtype)  # the batch as the precision converts it (Lightning's convert_input)
    # the Trainer builds its own later; DeepSpeed's host optimizers measured as the torch one of the same state
    optimizers = [stand_in(o) for o in _init_optimizers_and_lr_schedulers(pl_module)[0]]
    zero = _zero_of(section, trainer.world_size, host_is_device=trainer.strategy.root_device.type == "cpu",
                    dtype=dtype)
    # Lightning runs training_step under DeepSpeed as a call of the module (its forward redirection)
    return rank_steps(pl_module, sample.loss, optimizers, lambda rows: (*held, sample.held(rows)), zero,
                      redirected=True)


# DeepSpeed's host optimizers (what it asks for under offload) step through an op of their own that fake tensors
# cannot run (it reads the data pointers). Each keeps a torch optimizer's state, which measures in its stead: CPU
# Adam two moments (Adam's, which also keeps its step count as a tensor: 4 B a parameter more, an upper bound),
# CPU Adagrad the squares' sum (Adagrad's), CPU Lion one moment (SGD's momentum).
_HOST_OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "DeepSpeedCPUAdam": torch.optim.Adam,
    "DeepSpeedCPUAdagrad": torch.optim.Adagrad,
    "DeepSpeedCPULion": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
}


def stand_in(optimizer: Any) -> Any:
    """``optimizer`` for a step on fake tensors: a DeepSpeed host optimizer as the torch one of the same state
    (over the same parameter groups), any other as it is."""
    make = _HOST_OPTIMIZERS.get(type(optimizer).__name__)
    if make is None or not type(optimizer).__module__.startswith("deepspeed."):
        return optimizer
    return make([{"params": list(group["params"])} for group in optimizer.param_groups])


def _zero_of(section: dict[str, Any], world: int, host_is_device: bool = False,
             dtype: torch.dtype = torch.float32) -> Zero | Zero3:
    """The terms of a rank's step, from the ``zero_optimization`` section (DeepSpeed's defaults where it has none);
    ``host_is_device``: the rank's device is the host (DeepSpeed's CPU accelerator), where offload moves nothing
    off it."""
    def number(key: str) -> int:
        return int(float(section.get(key, _DEFAULTS[key])))

    if int(section["stage"]) == 3:
        given = {term: int(float(section[key])) for key, term in _ZERO3_KEYS.items() if key in section}
        offloaded = _offloaded(section)
        return Zero3(world=world, reduce_bucket_size=number("reduce_bucket_size"), **given,
                     memory_efficient_linear=bool(section.get("memory_efficient_linear", True)),
                     offload_optimizer="offload_optimizer" in offloaded, offload_param="offload_param" in offloaded,
                     host_is_device=host_is_device, dtype=dtype)
    return Zero(stage=int(section["stage"]), world=world, reduce_bucket_size=number("reduce_bucket_size"),
                overlap_comm=bool(section.get("overlap_comm", _DEFAULTS["overlap_comm"])), dtype=dtype)


def tracked(optimizers: Sequence[Any]) -> list[Any]:
    """What MemTracker is given to follow of ``optimizers``, which under DeepSpeed are its ZeRO optimizer: not a
    torch optimizer (MemTracker refuses it), but it holds one (``.optimizer``, over the fp32 partitions) and the
    tensors of its own (the flat parameters, the partitions, ``grads_in_partition``): those, found in its
    attributes, as the version of DeepSpeed names them."""
    out: list[Any] = []
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.Optimizer):
            out.append(optimizer)
            continue
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
        for value in vars(optimizer).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
            for item in items:
                for t in (item if isinstance(item, list | tuple) else [item]):
                    if not isinstance(t, torch.Tensor):  # ZeRO-3's reduce buckets: objects holding a buffer
                        if not isinstance(t, torch.nn.Module):  # (not the module: its tensors are the model's)
                            out += [v for v in getattr(t, "__dict__", {}).values() if isinstance(v, torch.Tensor)]
                        continue
                    if t.device.type != "meta":  # ZeRO-1/2 keep each parameter's shape as a meta tensor
                        out.append(t)  # (round_robin_bit16_meta): no memory, which MemTracker would count
                    if t.grad is not None:
                        out.append(t.grad)
    return out


__all__ = ["deepspeed_linear", "is_deepspeed", "is_zero3", "stand_in", "tracked", "zero_refused", "zero_steps"]
