"""timm's models for the zoo (issue #42): one tiny model per family that has timm's own checkpointing.

    python -m ckpt_tools.zoo timm.efficientnet timm.regnet timm.resnet timm.convnext timm.vit timm.swin timm.mobilenetv3

Each is built as timm's users build it, ``timm.create_model(name, pretrained=False,
num_classes=5, **sizes)`` (nothing downloaded), and trained as they train it:
``model(x)`` on a batch of two 32x32 images, cross-entropy against seeded labels.
The sizes shrink a model without changing how it nests its blocks: timm's own
``test_*`` configs where timm has one (its test suite's tiny models), else a
released config with fewer or narrower blocks; 32x32 images keep them fast.

``own`` is ``model.set_grad_checkpointing(True)``; ``units`` the classes timm
then checkpoints, in model order, as ``tests/test_timm.py`` observes them (the
modules its forward runs again in backward, outermost):

- ``efficientnet``: every block of every stage (``checkpoint_seq(self.blocks,
  x, flatten=True)``), stage 0's lone ``ConvBnAct`` too (EfficientNet-B0's is a
  ``DepthwiseSeparableConv``);
- ``regnet``: each stage's blocks ``b1``, ``b2``... (``checkpoint_seq(self.children())``
  in ``RegStage``), not the stages whole;
- ``resnet``: every block of ``layer1``-``layer4`` (timm's ``test_resnet``: one per
  stage, ``BasicBlock`` and ``Bottleneck`` mixed);
- ``convnext`` and ``swin``: each stage's ``blocks``, not its ``downsample``;
- ``vit``: its ``blocks``; ``mobilenetv3``: as EfficientNet.

timm imports torchvision; where the registry's torchvision cannot load its compiled
ops on this torch, importing ``ckpt_tools`` lets it import (``torchvision_cpu.py``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_tools.zoo import ZooModel

B, SIDE, CLASSES = 2, 32, 5  # images per batch, pixels a side (five halvings leave 1x1), classes

# name -> (timm's model name, the sizes given to create_model, timm's checkpointed classes in model order)
TIMM: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    # timm's test config: five stages of one block, three block classes; stage 0's ConvBnAct occurs once
    "efficientnet": ("test_efficientnet", {}, ("ConvBnAct", "EdgeResidual", "InvertedResidual")),
    # RegNetX-200MF's depth (13) and width multiplier, narrower (w0, wa 8; groups of 4): 1, 2, 6, 4 blocks a stage
    "regnet": ("regnetx_002", dict(depth=13, w0=8, wa=8.0, wm=2.49, group_size=4), ("Bottleneck",)),
    "resnet": ("test_resnet", {}, ("BasicBlock", "Bottleneck")),
    "convnext": ("test_convnext", dict(drop_path_rate=0.1), ("ConvNeXtBlock",)),
    "vit": ("test_vit", dict(img_size=SIDE, patch_size=8, depth=3, drop_path_rate=0.1), ("Block",)),
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=SIDE, window_size=4, embed_dim=16, depths=(1, 1, 2, 1),
                                                  num_heads=(1, 1, 2, 2), drop_path_rate=0.1),
             ("SwinTransformerBlock",)),
    # half the blocks of each stage, rounded up: 1, 2, 2, 1, 2, 1
    "mobilenetv3": ("mobilenetv3_small_050", dict(depth_multiplier=0.5),
                    ("DepthwiseSeparableConv", "InvertedResidual", "ConvBnAct")),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images() -> dict[str, Any]:
    return {"x": torch.randn(B, 3, SIDE, SIDE, generator=_gen(21))}  # (B, 3, H, W)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, torch.randint(CLASSES, (B,), generator=_gen(22)))  # logits: (B, CLASSES)


def build(name: str) -> nn.Module:
    """The zoo's timm model ``name`` (a key of :data:`TIMM`), seeded, in train mode."""
    import timm

    model_name, sizes, _ = TIMM[name]
    torch.manual_seed(0)
    return timm.create_model(model_name, pretrained=False, num_classes=CLASSES, **sizes).train()


def _own(model: nn.Module) -> None:
    model.set_grad_checkpointing(True)


def models() -> list[ZooModel]:
    """The timm entries, where timm is installed."""
    if importlib.util.find_spec("timm") is None:
        return []
    return [ZooModel(f"timm.{name}", "timm", lambda name=name: build(name), _images, _loss, _own, units)
            for name, (_, _, units) in TIMM.items()]


__all__ = ["TIMM", "build", "models"]
