"""``ckpt.deepspeed``: the options of DeepSpeed's own activation checkpointing, as a typed node.

    python recipes/train.py trainer=deepspeed_zero3 ckpt=deepspeed ckpt.deepspeed.partition_activations=true

By default the plugin checkpoints with torch's non-reentrant
``torch.utils.checkpoint`` under every strategy, DeepSpeed included: it is
correct under ZeRO-3, where ``deepspeed.checkpointing.non_reentrant_checkpoint``
is not (it keeps parameters ZeRO-3 has released; see notes/distributed-cpu.md).
DeepSpeed's options (partitioning activations across model-parallel ranks,
keeping them in CPU memory, a contiguous buffer) work only inside DeepSpeed's
own ``deepspeed.checkpointing.checkpoint`` (reentrant); ``ckpt.deepspeed``
switches the wrapped layers to it and configures it with every option.

Lightning's ``DeepSpeedStrategy`` passes only four of the six options on to
``deepspeed.checkpointing.configure`` and drops ``number_checkpoints`` and
``synchronize_checkpoint_boundary`` (Lightning#20329), and it never applies
checkpointing to the model (Lightning#9152, #11081): the callback calls
``configure`` itself, after the strategy has, with all six.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ckpt_plugin.errors import ConfigError, Problem


@dataclass(kw_only=True)
class DeepSpeedCheckpointing:
    """``ckpt.deepspeed``: the options of ``deepspeed.checkpointing.configure``, under DeepSpeed's config names."""

    partition_activations: bool = False  # split each kept input across model-parallel ranks
    cpu_checkpointing: bool = False  # keep the (partitioned) inputs in CPU memory
    contiguous_memory_optimization: bool = False  # copy them into one preallocated buffer
    number_checkpoints: Any = None  # checkpoints per forward: the buffer's size (contiguous needs it)
    synchronize_checkpoint_boundary: bool = False  # synchronize the device at each checkpoint's start and end
    profile: bool = False  # log the forward and backward time of each checkpoint

    def problems(self) -> list[Problem]:
        problems = [Problem(f"ckpt.deepspeed.{f.name}",
                            f"ckpt.deepspeed.{f.name}={getattr(self, f.name)!r} ({type(getattr(self, f.name)).__name__}) "
                            "must be true or false")
                    for f in fields(self) if f.name != "number_checkpoints" and not isinstance(getattr(self, f.name), bool)]
        n = self.number_checkpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            problems.append(Problem("ckpt.deepspeed.number_checkpoints",
                                    f"ckpt.deepspeed.number_checkpoints={n!r} must be null or an integer >= 1 "
                                    "(the number of checkpointed layers in one forward)"))
        # DeepSpeed asserts these inside configure(), in every process after launch; say so before.
        if self.contiguous_memory_optimization is True:
            if n is None:
                problems.append(Problem("ckpt.deepspeed.number_checkpoints",
                                        "ckpt.deepspeed.contiguous_memory_optimization=true needs "
                                        "ckpt.deepspeed.number_checkpoints (the number of checkpointed layers, "
                                        "e.g. the model's n_layer): DeepSpeed sizes the contiguous buffer from it"))
            if self.partition_activations is not True:
                problems.append(Problem("ckpt.deepspeed.partition_activations",
                                        "ckpt.deepspeed.contiguous_memory_optimization=true needs "
                                        "ckpt.deepspeed.partition_activations=true (DeepSpeed keeps only "
                                        "partitioned activations in the contiguous buffer)"))
        return problems


def settings_of(value: Any) -> DeepSpeedCheckpointing | None:
    """``ckpt.deepspeed`` as given (None, a mapping or the dataclass) to the dataclass.

    Raises :class:`ConfigError` for anything else, or for unknown keys.
    """
    if value is None or isinstance(value, DeepSpeedCheckpointing):
        return value
    valid = [f.name for f in fields(DeepSpeedCheckpointing)]
    if not isinstance(value, dict):
        raise ConfigError([Problem("ckpt.deepspeed",
                                   f"ckpt.deepspeed={value!r} must be null or a mapping of DeepSpeed's checkpointing "
                                   f"options ({', '.join(valid)})", "e.g. ckpt=deepspeed")])
    unknown = [k for k in value if k not in valid]
    if unknown:
        raise ConfigError([Problem(f"ckpt.deepspeed.{unknown[0]}", f"unknown key ckpt.deepspeed.{unknown[0]}",
                                   f"valid keys: {', '.join(valid)}")])
    return DeepSpeedCheckpointing(**value)


__all__ = ["DeepSpeedCheckpointing", "settings_of"]
