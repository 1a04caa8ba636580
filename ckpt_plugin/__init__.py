"""ckpt_plugin: activation checkpointing for PyTorch Lightning, configured through Hydra.

    python recipes/train.py ckpt.layers=TransformerBlock
"""

from .callback import ActivationCheckpointing
from .config import FullConfig, NoneConfig, make_config
from .report import WrapReport
from .wrapping import apply_checkpointing, remove_checkpointing, wrapped_modules

__all__ = [
    "ActivationCheckpointing",
    "FullConfig",
    "NoneConfig",
    "WrapReport",
    "apply_checkpointing",
    "make_config",
    "remove_checkpointing",
    "wrapped_modules",
]
