"""What the callback checks and sets up for the Lightning strategy it runs under.

The plugin wraps the same way under every strategy (an instance-level
``forward`` on the selected layers, torch's non-reentrant checkpoint): DDP,
FSDP, FSDP2 (``ModelParallelStrategy``) and DeepSpeed ZeRO 1-3 each run the
wrapped layers' forward inside their own hooks, and the recomputation triggers
them again where parameters must be gathered. Two things depend on the strategy:

- checkpointing the strategy already applied (FSDPStrategy's
  ``activation_checkpointing_policy``, or a torch ``checkpoint_wrapper``): the
  layers would be checkpointed twice, so it is an error, never silent;
- DeepSpeed's own checkpoint (``ckpt.deepspeed``): needs a DeepSpeed strategy,
  and ``deepspeed.checkpointing.configure`` with all its options.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ckpt_plugin._compat import checkpoint_wrapper_type
from ckpt_plugin.engine.deepspeed import configure
from ckpt_plugin.errors import ConfigError, Problem


def _is_deepspeed(strategy: Any) -> bool:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return isinstance(strategy, DeepSpeedStrategy)


def already_checkpointed(model: nn.Module) -> list[str]:
    """Qualified names of modules that torch's ``checkpoint_wrapper`` wraps (FSDP's policy does this)."""
    wrapper = checkpoint_wrapper_type()
    return [name for name, m in model.named_modules() if isinstance(m, wrapper)]


def prepare(strategy: Any, model: nn.Module, config: Any) -> None:
    """Check ``config`` against the strategy and set DeepSpeed up; raises before anything is wrapped."""
    twice = already_checkpointed(model)
    if twice:
        name = type(strategy).__name__
        source = (f"trainer.strategy ({name}) activation_checkpointing_policy / activation_checkpointing"
                  if "FSDP" in name else "torch's checkpoint_wrapper (applied outside this plugin)")
        raise ConfigError([Problem(
            "ckpt.layers",
            f"{len(twice)} module(s) are already checkpointed by {source}: {', '.join(twice[:3])}"
            f"{', ...' if len(twice) > 3 else ''}. Checkpointing them again with callbacks.activation_checkpointing "
            "would recompute every block twice",
            "use one of the two: remove the strategy's activation_checkpointing_policy (the plugin works "
            "under every strategy), or choose ckpt=none",
        )])
    settings = getattr(config, "deepspeed", None)
    deepspeed = _is_deepspeed(strategy)
    if settings is not None and not deepspeed:
        raise ConfigError([Problem(
            "ckpt.deepspeed",
            f"ckpt.deepspeed is set but trainer.strategy is {type(strategy).__name__}: DeepSpeed's own "
            "checkpoint needs a DeepSpeed strategy (Trainer(strategy='deepspeed_stage_3'), or the recipe's "
            "trainer=deepspeed_zero1/2/3)",
            "under any other strategy leave ckpt.deepspeed unset (torch's checkpoint is used)",
        )])
    if deepspeed and settings is None:
        ignored = strategy_settings(strategy)
        if ignored:
            keys = ", ".join(f"{k}={v}" for k, v in ignored.items())
            rank_zero_warn(
                f"trainer.strategy sets DeepSpeed activation-checkpointing options ({keys}) that take effect only "
                "inside DeepSpeed's own checkpoint; the plugin checkpoints with torch's non-reentrant "
                "checkpoint, so they are ignored. To use them, move them into the ckpt node: "
                f"ckpt=deepspeed {' '.join(f'ckpt.deepspeed.{k}={str(v).lower()}' for k, v in ignored.items())}"
            )
    if settings is not None:
        configure(settings)  # after the strategy's own configure call, which drops two options


def strategy_settings(strategy: Any) -> dict[str, Any]:
    """The activation-checkpointing options set (true) in a DeepSpeedStrategy's config, else {}."""
    config = getattr(strategy, "config", None)
    section = config.get("activation_checkpointing") if isinstance(config, dict) else None
    return {k: v for k, v in (section or {}).items() if v}
