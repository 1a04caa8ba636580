"""ckpt_plugin: activation checkpointing for PyTorch Lightning, configured through Hydra.

    python recipes/train.py ckpt.layers=TransformerBlock
"""

from .callback import ActivationCheckpointing
from .config import FullConfig, NoneConfig, OffloadConfig, SelectiveConfig, make_config
from .functional import checkpoint
from .offload import offloading
from .policies import checkpoint_name, make_policy
from .report import WrapReport
from .deepspeed_ckpt import DeepSpeedCheckpointing
from .recompute_check import RecomputationMismatch, checking_recomputed_values
from .residuals import SavedActivations, saved_activations
from .resume import ResumableDataLoader, ResumableRNG
from .scan import checkpoint_scan
from .sequential import checkpoint_sequential
from .wrapping import apply_checkpointing, remove_checkpointing, wrapped_modules

__all__ = [
    "ActivationCheckpointing",
    "DeepSpeedCheckpointing",
    "FullConfig",
    "NoneConfig",
    "OffloadConfig",
    "RecomputationMismatch",
    "ResumableDataLoader",
    "ResumableRNG",
    "SavedActivations",
    "SelectiveConfig",
    "WrapReport",
    "apply_checkpointing",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_scan",
    "checkpoint_sequential",
    "checking_recomputed_values",
    "make_config",
    "make_policy",
    "offloading",
    "remove_checkpointing",
    "saved_activations",
    "wrapped_modules",
]
