"""The zoo's libraries of issue #42 (item 5): medical 3D networks, a contrastive image-text model, a neural
operator and an equivariant network.

    python -m ckpt_tools.zoo --budget monai.swin_unetr monai.unetr monai.unet coca.coca neuralop.fno e3nn.simple_network

Each entry is built from a tiny config as its library's users build it and
called as their training loop calls it, with the library's own loss:

- ``medical-3d``: MONAI's ``SwinUNETR``, ``UNETR`` and ``UNet`` on 3D volumes
  (one input channel, two classes), trained with ``monai.losses.DiceCELoss(
  to_onehot_y=True, softmax=True)`` against integer label volumes, as MONAI's
  segmentation tutorials do. MONAI's own checkpointing: SwinUNETR's
  ``use_checkpoint=True`` (each ``SwinTransformerBlock``'s attention half and
  MLP half, ``torch.utils.checkpoint``), and ``CheckpointUNet``, UNet's
  subclass that checkpoints every connection block's down path, up path and
  inner block (nested). UNETR has none. Both are constructor choices, so
  ``own`` builds the model again with them (same seed, same weights).
- ``contrastive``: lucidrains' ``CoCa`` (Contrastive Captioners, coca-pytorch),
  ``coca(text=..., images=..., return_loss=True)``: its own caption loss plus
  its own contrastive loss. Its image encoder is the user's to give (a ViT
  returning ``(batch, tokens, dim)``): here patches by a strided convolution,
  then x-transformers' ``Encoder`` (already in the zoo), the tower of a ViT.
  No checkpointing of its own.
- ``neural-operator``: neuraloperator's ``FNO`` (2D, four Fourier layers) on a
  batch of functions on a 32x32 grid, with its ``LpLoss(d=2, p=2)`` (the
  relative L2 error its Darcy-flow examples report, beside ``H1Loss``). No
  checkpointing of its own.
- ``equivariant``: e3nn's ``SimpleNetwork`` (``e3nn.nn.models.v2106``: gated
  equivariant convolutions over a radius graph) on two point clouds, the pooled
  scalar and vector outputs regressed with a mean squared error (e3nn has no
  loss of its own). Its forward reads values: the radius graph's ``nonzero``
  and ``int(batch.max())``. No checkpointing of its own.

Every target comes from a seeded generator, so two steps match bit for bit.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_tools.zoo import ZooModel


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build().train()
    return seeded


# ------------------------------------------------------------------------------------------ medical-3d: MONAI

B = 2  # volumes per batch
SWIN_SIDES = (32, 32, 64)  # SwinUNETR divides each side by 2**5; its deepest InstanceNorm needs > 1 voxel: 1x1x2
UNETR_SIDES = (32, 32, 32)  # UNETR's ViT cuts 16**3 patches: 8 tokens
UNET_SIDES = (16, 16, 16)  # UNet with two stride-2 levels: 4**3 at the bottom
CLASSES = 2  # background and one organ


def _volumes(sides: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(B, 1, *sides, generator=_gen(21))  # (B, 1, D, H, W)


def _dice_ce(sides: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """MONAI's Dice plus cross-entropy of ``(B, CLASSES, D, H, W)`` logits against a label volume ``(B, 1, D, H, W)``
    of class indices, one-hot encoded and softmaxed by the loss itself."""
    def loss(logits: torch.Tensor) -> torch.Tensor:
        from monai.losses import DiceCELoss

        labels = torch.randint(CLASSES, (B, 1, *sides), generator=_gen(22))
        return DiceCELoss(to_onehot_y=True, softmax=True)(logits, labels)
    return loss


SWIN = dict(in_channels=1, out_channels=CLASSES, feature_size=12, depths=(2, 2, 2, 2), num_heads=(3, 6, 12, 24),
            window_size=4)  # feature_size: a multiple of 12; two blocks per stage, the second's windows shifted
UNET = dict(spatial_dims=3, in_channels=1, out_channels=CLASSES, channels=(8, 16, 32), strides=(2, 2),
            num_res_units=2)


def _swin_unetr(**switch: Any) -> nn.Module:
    from monai.networks.nets import SwinUNETR

    return SwinUNETR(**SWIN, **switch)


def _unetr() -> nn.Module:
    from monai.networks.nets import UNETR

    return UNETR(in_channels=1, out_channels=CLASSES, img_size=UNETR_SIDES, feature_size=8, hidden_size=32,
                 mlp_dim=64, num_heads=2)


def _unet() -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(**UNET)


def _checkpoint_unet() -> nn.Module:
    from monai.networks.nets.unet import CheckpointUNet  # not exported by monai.networks.nets (MONAI 1.6)

    return CheckpointUNet(**UNET)


def _rebuilt(build: Callable[[], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """MONAI's own checkpointing is a constructor's choice: ``own`` builds the model again with it, from the same
    seed (the same weights; CheckpointUNet's names gain a ``.module`` per wrapper)."""
    return lambda model: _seeded(build)()


def _monai(name: str, build: Callable[..., nn.Module], sides: tuple[int, ...], units: tuple[str, ...],
           own: Callable[[nn.Module], nn.Module] | None, x: str = "x") -> ZooModel:
    return ZooModel(f"monai.{name}", "medical-3d", _seeded(build), lambda: {x: _volumes(sides)}, _dice_ce(sides),
                    own, units)


# ---------------------------------------------------------------------------------------- contrastive: CoCa

TEXT, VOCAB, IMAGE = 12, 64, 16  # caption tokens, vocabulary, image side (4x4 patches of 4x4 pixels)


def _coca() -> nn.Module:
    import x_transformers
    from coca_pytorch import CoCa
    from einops.layers.torch import Rearrange

    vit = nn.Sequential(nn.Conv2d(3, 32, 4, stride=4), Rearrange("b d h w -> b (h w) d"),  # (B, 16, 32)
                        x_transformers.Encoder(dim=32, depth=2, heads=2))
    return CoCa(dim=32, num_tokens=VOCAB, unimodal_depth=2, multimodal_depth=2, image_dim=32, num_img_queries=8,
                dim_head=16, heads=2, img_encoder=vit)


def _coca_batch() -> dict[str, Any]:
    gen = _gen(23)
    return {"text": torch.randint(1, VOCAB, (B, TEXT), generator=gen),  # 0 is CoCa's pad_id
            "images": torch.randn(B, 3, IMAGE, IMAGE, generator=gen), "return_loss": True}


def _its_loss(loss: torch.Tensor) -> torch.Tensor:
    """CoCa with ``return_loss=True`` returns its loss: caption cross-entropy plus contrastive (both directions)."""
    return loss


# ----------------------------------------------------------------------------------- neural-operator: FNO

GRID = 32  # a 32x32 discretisation of the input function


def _fno() -> nn.Module:
    from neuralop.models import FNO

    return FNO(n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=16, n_layers=4)


def _lp_loss(prediction: torch.Tensor) -> torch.Tensor:
    from neuralop.losses import LpLoss

    solution = torch.randn(B, 1, GRID, GRID, generator=_gen(25))  # (B, 1, GRID, GRID)
    return LpLoss(d=2, p=2)(prediction, solution)


# ---------------------------------------------------------------------------------------- equivariant: e3nn

POINTS = 8  # per cloud; two clouds


def _e3nn() -> nn.Module:
    from e3nn.nn.models.v2106.gate_points_networks import SimpleNetwork

    return SimpleNetwork(irreps_in="3x0e", irreps_out="1x0e+1x1o", max_radius=1.5, num_neighbors=3.0,
                         num_nodes=POINTS, mul=4, layers=2, lmax=1)


def _clouds() -> dict[str, Any]:
    gen = _gen(26)
    return {"data": {"pos": torch.randn(2 * POINTS, 3, generator=gen),  # (N, 3)
                     "x": torch.randn(2 * POINTS, 3, generator=gen),  # three scalars per point
                     "batch": torch.arange(2).repeat_interleave(POINTS)}}  # which cloud each point is in


def _mse(pooled: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pooled, torch.randn(2, 4, generator=_gen(27)))  # (clouds, 1 scalar + 1 vector)


def models() -> list[ZooModel]:
    """The entries whose library imports here (each library is skipped alone when it is missing)."""
    found = {name: importlib.util.find_spec(name) is not None for name in ("monai", "coca_pytorch", "neuralop", "e3nn")}
    out: list[ZooModel] = []
    if found["monai"]:
        out += [
            # MONAI checkpoints SwinTransformerBlock's halves; auto's general rule takes those blocks and the
            # convolutional encoder and decoder blocks around them
            _monai("swin_unetr", _swin_unetr, SWIN_SIDES, ("SwinTransformerBlock", "UnetrBasicBlock", "UnetrUpBlock"),
                   _rebuilt(lambda: _swin_unetr(use_checkpoint=True)), x="x_in"),
            _monai("unetr", _unetr, UNETR_SIDES, ("TransformerBlock", "UnetResBlock", "UnetrPrUpBlock", "UnetrUpBlock"),
                   None, x="x_in"),
            _monai("unet", _unet, UNET_SIDES, ("ResidualUnit",), _rebuilt(_checkpoint_unet)),
        ]
    if found["coca_pytorch"]:
        # "Residual" is CoCa's class and x-transformers' (its residual additions): a class name matches both
        out.append(ZooModel("coca.coca", "contrastive", _seeded(_coca), _coca_batch, _its_loss, None,
                            ("Attention", "FeedForward", "Residual")))
    if found["neuralop"]:
        out.append(ZooModel("neuralop.fno", "neural-operator", _seeded(_fno),
                            lambda: {"x": torch.randn(B, 1, GRID, GRID, generator=_gen(24))}, _lp_loss, None,
                            ("SpectralConv", "ChannelMLP")))
    if found["e3nn"]:
        out.append(ZooModel("e3nn.simple_network", "equivariant", _seeded(_e3nn), _clouds, _mse, None, ("Compose",)))
    return out


__all__ = ["models"]
