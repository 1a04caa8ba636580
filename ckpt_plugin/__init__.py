"""ckpt_plugin: activation checkpointing for PyTorch Lightning, configured through Hydra.

    python recipes/train.py ckpt.layers=TransformerBlock

Every public name is imported on first use (PEP 562), so importing costs what
you use: ``from ckpt_plugin import apply_checkpointing, checkpoint`` loads
torch and the engine, never Lightning or Hydra; ``ckpt_plugin.ActivationCheckpointing``
loads Lightning when it is first touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "ActivationCheckpointing": "ckpt_plugin.lightning.callback",
    "ResumableRNG": "ckpt_plugin.runs.resume",
    "Preemption": "ckpt_plugin.runs.preemption",
    "Preempted": "ckpt_plugin.runs.preemption",
    "AtomicCheckpointIO": "ckpt_plugin.runs.atomic",
    "AutoConfig": "ckpt_plugin.config.schema",
    "FullConfig": "ckpt_plugin.config.schema",
    "NoneConfig": "ckpt_plugin.config.schema",
    "OffloadConfig": "ckpt_plugin.config.schema",
    "SelectiveConfig": "ckpt_plugin.config.schema",
    "make_config": "ckpt_plugin.config.schema",
    "DeepSpeedCheckpointing": "ckpt_plugin.config.deepspeed",
    "apply_checkpointing": "ckpt_plugin.apply.install",
    "ConfigError": "ckpt_plugin.errors",
    "Problem": "ckpt_plugin.errors",
    "remove_checkpointing": "ckpt_plugin.engine.wrap",
    "wrapped_modules": "ckpt_plugin.engine.wrap",
    "checkpoint": "ckpt_plugin.engine.functional",
    "offloading": "ckpt_plugin.engine.offload",
    "checkpoint_name": "ckpt_plugin.engine.selective.policies",
    "make_policy": "ckpt_plugin.engine.selective.policies",
    "RecomputationMismatch": "ckpt_plugin.engine.recompute_check",
    "checking_recomputation": "ckpt_plugin.engine.recompute_check",
    "checking_recomputed_values": "ckpt_plugin.engine.recompute_check",
    "checkpoint_scan": "ckpt_plugin.engine.scan.scan",
    "checkpoint_sequential": "ckpt_plugin.engine.segments.sequential",
    "WrapReport": "ckpt_plugin.measure.report",
    "SavedActivations": "ckpt_plugin.measure.residuals",
    "saved_activations": "ckpt_plugin.measure.residuals",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ckpt_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # next time without __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from ckpt_plugin.config.deepspeed import DeepSpeedCheckpointing
    from ckpt_plugin.apply.install import apply_checkpointing
    from ckpt_plugin.config.schema import AutoConfig, FullConfig, NoneConfig, OffloadConfig, SelectiveConfig, make_config
    from ckpt_plugin.engine.functional import checkpoint
    from ckpt_plugin.engine.offload import offloading
    from ckpt_plugin.engine.selective.policies import checkpoint_name, make_policy
    from ckpt_plugin.engine.recompute_check import (
        RecomputationMismatch,
        checking_recomputation,
        checking_recomputed_values,
    )
    from ckpt_plugin.engine.scan.scan import checkpoint_scan
    from ckpt_plugin.engine.segments.sequential import checkpoint_sequential
    from ckpt_plugin.engine.wrap import remove_checkpointing, wrapped_modules
    from ckpt_plugin.errors import ConfigError, Problem
    from ckpt_plugin.runs.atomic import AtomicCheckpointIO
    from ckpt_plugin.lightning.callback import ActivationCheckpointing
    from ckpt_plugin.runs.preemption import Preempted, Preemption
    from ckpt_plugin.runs.resume import ResumableRNG
    from ckpt_plugin.measure.report import WrapReport
    from ckpt_plugin.measure.residuals import SavedActivations, saved_activations
