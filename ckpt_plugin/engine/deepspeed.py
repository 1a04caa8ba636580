"""DeepSpeed's own checkpoint for the engine: ``configure`` with every option, and one checkpointed call; and
ZeRO-3's linear, which its engine installs for the process.

Used when ``ckpt.deepspeed`` is set (see ``config/deepspeed.py`` for why the
plugin otherwise keeps torch's checkpoint under DeepSpeed). DeepSpeed is
imported on use: nothing here loads it unless a plan asks for it. The settings
object is anything with DeepSpeed's six option names as attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckpt_plugin.engine.norms import keep_running_stats


def configure(settings: Any) -> None:
    """``deepspeed.checkpointing.configure`` with every option (needs the process group)."""
    import deepspeed

    deepspeed.checkpointing.configure(
        mpu_=None,
        partition_activations=settings.partition_activations,
        contiguous_checkpointing=settings.contiguous_memory_optimization,
        num_checkpoints=settings.number_checkpoints,
        checkpoint_in_cpu=settings.cpu_checkpointing,
        synchronize=settings.synchronize_checkpoint_boundary,
        profile=settings.profile,
    )


def checkpointed_call(fn: Callable[..., Any], stats: list, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under ``deepspeed.checkpointing.checkpoint``.

    DeepSpeed's checkpoint takes no ``context_fn``: the BatchNorm fix
    (pytorch#96136) wraps the function instead, undoing what its second call,
    the recomputation, writes into running statistics.
    """
    import deepspeed

    calls = 0

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*inner_args, **inner_kwargs)
        with keep_running_stats(stats):
            return fn(*inner_args, **inner_kwargs)

    return deepspeed.checkpointing.checkpoint(run, *args, **kwargs)  # it passes keyword tensors on itself


def memory_efficient_linear() -> Callable[..., Any]:
    """DeepSpeed's ZeRO-3 ``torch.nn.functional.linear`` (``memory_efficient_linear``, which its engine installs for
    the whole process): an ``autograd.Function`` that saves the weight itself for backward, not a view of its data.
    ZeRO-3's gathering, played on the fake step, runs under it (``apply/zero3_gather.py``)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    return zero3_linear_wrap


__all__ = ["checkpointed_call", "configure", "memory_efficient_linear"]
