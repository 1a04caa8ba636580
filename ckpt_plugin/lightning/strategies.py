"""What the callback checks and sets up for the Lightning strategy it runs under.

The plugin wraps the same way under every strategy (an instance-level
``forward`` on the selected layers, torch's non-reentrant checkpoint): DDP,
FSDP, FSDP2 (``ModelParallelStrategy``) and DeepSpeed ZeRO 1-3 each run the
wrapped layers' forward inside their own hooks, and the recomputation triggers
them again where parameters must be gathered. Three things depend on the strategy:

- checkpointing the strategy already applied (FSDPStrategy's
  ``activation_checkpointing_policy``, or a torch ``checkpoint_wrapper``): the
  layers would be checkpointed twice, so it is an error, never silent;
- DeepSpeed's own checkpoint (``ckpt.deepspeed``): needs a DeepSpeed strategy,
  and ``deepspeed.checkpointing.configure`` with all its options;
- ``ckpt=auto`` under several processes: whether rank 0 may profile alone while
  the others wait at the broadcast of its plan, and where no rank can profile at
  all (parameters sharded or gradients hooked by the strategy).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ckpt_plugin._compat import checkpoint_wrapper_type
from ckpt_plugin.engine.deepspeed import configure
from ckpt_plugin.config.schema import AutoConfig, CkptConfig
from ckpt_plugin.errors import ConfigError, Problem
from ckpt_plugin.lightning.fsdp import plans_on_a_twin, tensor_parallel_refused
from ckpt_plugin.lightning.zero import is_deepspeed, zero_refused


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
    deepspeed = is_deepspeed(strategy)
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


# -- ckpt=auto under several processes: who may plan, and how rank 0's plan (or error) reaches the others --

def rank_zero_plans_alone(strategy: Any, model: nn.Module) -> bool:
    """Whether rank 0 can profile while the other ranks wait: the LightningModule's forward issues no collective.

    DDP's collectives run in backward, and only for a forward through its wrapper (its reducer expects
    gradients after ``DistributedDataParallel.forward``); the profile calls the LightningModule itself. FSDP,
    FSDP2 and ZeRO-3 gather parameters in the forward; DeepSpeed's strategy is a DDPStrategy, and is left
    out too; SyncBatchNorm all-gathers its statistics in every training forward.
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    if not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy):
        return False
    return not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


def sharded_parameters(strategy: Any) -> str | None:
    """The strategy's class name where the LightningModule's parameters are sharded between steps (FSDP,
    FSDP2, DeepSpeed ZeRO-3): a forward of the module outside the strategy's own call meets shards, and
    one on fake tensors leaves fake tensors in the strategy's state. Else None."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if plans_on_a_twin(strategy):
        return type(strategy).__name__
    if isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:
        return _deepspeed_name(strategy)
    return None


def plans_before_wrapping(strategy: Any) -> bool:
    """Whether ``ckpt=auto`` plans in the callback's ``setup``, on the module whole, before the strategy shards it
    or hooks its parameters: FSDP and FSDP2 (each whole step on a fake twin, ``fsdp.py``) and DeepSpeed."""
    return plans_on_a_twin(strategy) or is_deepspeed(strategy)


def _deepspeed_name(strategy: Any) -> str:
    return f"{type(strategy).__name__} (ZeRO stage {strategy.config.get('zero_optimization', {}).get('stage')})"


def planning_refused(strategy: Any, config: CkptConfig) -> ConfigError | None:
    """The error for ckpt=auto planning what is not modelled under the strategy, else None.

    The profile runs the LightningModule's forward and backward on fake tensors and times layers on real
    ones, outside the strategy's own call (2 gloo processes on CPU, torch 2.13, Lightning 2.6.6): at fit
    start FSDP's root unit's parameters were flat 1-D shards; FSDP2 kept the fake all-gathered parameters
    and ran the next training step on them; DeepSpeed's gradient hooks (ZeRO-1 and 2 too) took the fake
    gradients and failed in the first real backward. So under these strategies the plan is made in ``setup``
    (``callback.py``), before the strategy shards or hooks anything, and under ModelParallelStrategy before the
    module's configure_model shards it with FSDP2. Under DeepSpeed that plans the activations (``ckpt.budget``):
    a ZeRO rank's forward runs each layer with its parameters whole, as the module's forward runs it. Its whole
    step (``ckpt.memory``, ``ckpt.batch=max``) is modelled for ZeRO-1, 2 and 3 in 32 bits and bf16 (``zero.py``), the
    rest refused there, naming the key. Tensor parallel under ModelParallelStrategy is refused (``fsdp.py``). A
    given plan (ckpt.plan) runs no profile: allowed.
    """
    if not isinstance(config, AutoConfig) or config.plan is not None:
        return None
    if not is_deepspeed(strategy):
        return tensor_parallel_refused(strategy)
    name = _deepspeed_name(strategy)
    if config.read_memory is not None:
        return zero_refused(strategy, "ckpt.memory", config.memory)
    if config.batch == "max":
        return zero_refused(strategy, "ckpt.batch", config.batch)
    budget, precision = config.read_budget, str(getattr(strategy.precision_plugin, "precision", "32-true"))
    if budget is not None and budget.bytes is not None and precision not in ("32-true", "32", "64-true", "64"):
        return ConfigError([Problem(
            "ckpt.budget",
            f"ckpt.budget={config.budget} under trainer.strategy {name} with precision {precision}: rank 0 plans "
            "before DeepSpeed wraps the module, while it is still in float32, and DeepSpeed casts it to "
            f"{precision}'s dtype afterwards, so a size would be measured against activations of the wrong width",
            "give a fraction of the activation peak without checkpointing (ckpt.budget=0.5), which does not "
            "depend on the width, or min",
        )])
    return None


def fake_step_refused(strategy: Any, backward: bool) -> str | None:
    """Why the report's step on fake tensors cannot run on the module at fit start (``backward``: one with a
    backward, ckpt=auto's peaks), else None: parameters sharded (FSDP, FSDP2, ZeRO-3), or DeepSpeed's gradient
    hooks on the parameters (ZeRO-1 and 2), which would take fake gradients."""
    name = sharded_parameters(strategy)
    if name is not None:
        return f"under {name}: the report's step on fake tensors would run into the parameters it shards"
    if backward and is_deepspeed(strategy):
        name = _deepspeed_name(strategy)
        return f"under {name}: its gradient hooks would take the fake gradients of the report's step"
    return None


def error_as_data(error: BaseException) -> dict[str, Any]:
    """An error on rank 0, as plain data for the broadcast: a ConfigError's problems, else its words."""
    if isinstance(error, ConfigError):
        return {"problems": [[p.key, p.problem, p.fix] for p in error.problems], "what": error.what}
    return {"message": f"{type(error).__name__}: {error}"}


def error_from_data(data: dict[str, Any]) -> Exception:
    if "problems" in data:
        return ConfigError([Problem(*p) for p in data["problems"]], data["what"])
    return RuntimeError(f"ckpt=auto: rank 0 could not plan, so no rank installs a plan: {data['message']}")
