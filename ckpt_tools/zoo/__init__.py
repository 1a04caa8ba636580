"""A zoo of models nobody here wrote, built from tiny configs, for what ``layers=auto`` decides.

    python -m ckpt_tools.zoo            # per model: what auto chose, activation peaks none / ours / own
    python -m ckpt_tools.zoo --budget   # also ckpt=auto ckpt.budget=0.5: met, or refused and the least run

Each :class:`ZooModel` builds one model as its library's users build it (a
config, nothing downloaded), and calls it as they call it in training. The
test suite (``tests/test_zoo.py``) and the tool share these entries.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ZooModel:
    """One outside model: how to build it, call it, and switch on its library's own checkpointing."""

    name: str  # "hf.swin", "torch.transformer_encoder", "timm.efficientnet"
    family: str  # decoder | encoder | encoder-decoder | moe | state-space | vision | audio | torch | shape
    #              | protein | graph | einx | torchtune | diffusion | medical-3d | contrastive | neural-operator
    #              | equivariant | timm
    build: Callable[[], nn.Module]  # tiny and deterministic (seeds itself), in train mode
    batch: Callable[[], dict[str, Any]]  # keyword arguments of one training call, as the library's users give them
    loss: Callable[[Any], torch.Tensor]  # the call's output -> the scalar loss
    # switches on the library's own checkpointing: on the model given (returns None), or returns the model built
    # with it where the library makes that a constructor's choice (MONAI); None: the library has none
    own: Callable[[nn.Module], nn.Module | None] | None
    units: tuple[str, ...]  # class names of the modules the library itself checkpoints (what auto should pick)

    def step(self, model: nn.Module) -> torch.Tensor:
        """One forward and backward; returns the loss."""
        loss = self.loss(model(**self.batch()))
        loss.backward()
        return loss


def hf_loss(output: Any) -> torch.Tensor:
    """A Hugging Face model's loss when ``labels`` were given; else the mean of its first output."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    first = output[0] if isinstance(output, (tuple, list)) else next(iter(output.values()))
    return first.float().pow(2).mean()


def all_models() -> list[ZooModel]:
    """Every zoo entry: Hugging Face (if transformers imports), torch's own, the shapes, the families of issue #33
    (``families.py``: proteins, graphs, einx, torchtune), timm's (``timm_models.py``, issue #42, if timm is
    installed), diffusion (``diffusion.py``, where it exists) and the libraries of issue #42 (``libraries.py``:
    MONAI, CoCa, neuraloperator, e3nn; each where it imports)."""
    from ckpt_tools.zoo import families, hf, libraries, timm_models, torch_models

    entries = [*hf.models(), *torch_models.models(), *families.models(), *timm_models.models()]
    if importlib.util.find_spec("ckpt_tools.zoo.diffusion") is not None:  # written beside this one (issue #33)
        from ckpt_tools.zoo import diffusion

        entries += diffusion.models()
    return entries + libraries.models()


__all__ = ["ZooModel", "all_models", "hf_loss"]
