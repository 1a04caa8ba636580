"""diffusers models for the zoo: one tiny model per architecture, called as a training step calls it.

    python -m ckpt_tools.zoo            # every entry, these included (once all_models() lists them)

Each entry builds the model its users train (the denoiser of Stable Diffusion
1.x/2.x, DiT, PixArt-alpha, Stable Diffusion 3, Flux, and Stable Diffusion's
VAE) from a config whose sizes alone are shrunk: width 32, two repeated blocks
per stack, 8x8 latents (16x16 images for the VAE). Nothing is downloaded.

A batch is what a diffusers training script hands the model: noisy latents,
their timesteps, and the conditioning (a text encoder's hidden states, pooled
projections, class labels, Flux's position ids); the loss is the mean squared
error against the noise (the VAE: the reconstruction against its input, from a
posterior sample drawn with a seeded generator, so that two runs are bitwise).

``own`` is diffusers' ``model.enable_gradient_checkpointing()``; ``units`` the
classes it then calls through ``self._gradient_checkpointing_func``, found by
running it, in model order (a UNet block registers its attentions before its
resnets). Where diffusers checkpoints inside a module it already checkpoints
(the VAE's mid block, then its ``ResnetBlock2D`` s again inside it), the outer
one: the inner checkpoints run only within the outer one's recomputation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_tools.zoo import ZooModel

B, C, SIDE, TOKENS, WIDTH = 2, 4, 8, 6, 32  # batch, latent channels, latent side, caption tokens, width
PIXELS = 16  # the VAE's image side: one downsampling to 8x8 latents


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _noise() -> torch.Tensor:
    """The noise a step adds to its latents, ``(B, C, SIDE, SIDE)``: the target of every denoiser here."""
    return torch.randn(B, C, SIDE, SIDE, generator=_gen(1))


def _noisy_latents() -> torch.Tensor:
    """Clean latents with noise added at each row's timestep (DDPM's ``add_noise``, alphas rounded)."""
    latents = torch.randn(B, C, SIDE, SIDE, generator=_gen(2))
    alpha = torch.tensor([0.9, 0.3]).view(B, 1, 1, 1)
    return alpha.sqrt() * latents + (1 - alpha).sqrt() * _noise()


def _captions() -> torch.Tensor:
    """A text encoder's hidden states, ``(B, TOKENS, WIDTH)``."""
    return torch.randn(B, TOKENS, WIDTH, generator=_gen(3))


STEPS = torch.tensor([100, 700])  # one timestep per row, out of 1000


def unet_batch() -> dict[str, Any]:
    return dict(sample=_noisy_latents(), timestep=STEPS, encoder_hidden_states=_captions())


def dit_batch() -> dict[str, Any]:
    return dict(hidden_states=_noisy_latents(), timestep=STEPS, class_labels=torch.tensor([1, 3]))


def pixart_batch() -> dict[str, Any]:
    # PixArt-alpha at 512 px and below takes no resolution / aspect-ratio conditions; its pipeline passes None
    return dict(hidden_states=_noisy_latents(), timestep=STEPS, encoder_hidden_states=_captions(),
                added_cond_kwargs=dict(resolution=None, aspect_ratio=None))


def sd3_batch() -> dict[str, Any]:
    # flow matching: sigma * 1000 as the timestep, a float
    return dict(hidden_states=_noisy_latents(), timestep=STEPS.float(), encoder_hidden_states=_captions(),
                pooled_projections=torch.randn(B, 16, generator=_gen(4)))


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """Flux's 2x2 patches as tokens: ``(B, C, H, W)`` -> ``(B, H/2 * W/2, 4C)`` (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


def flux_batch() -> dict[str, Any]:
    rows, cols = torch.meshgrid(torch.arange(SIDE // 2), torch.arange(SIDE // 2), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()  # (tokens, 3)
    return dict(hidden_states=_pack(_noisy_latents()), timestep=STEPS.float() / 1000,
                encoder_hidden_states=_captions(), pooled_projections=torch.randn(B, 16, generator=_gen(4)),
                img_ids=image_ids, txt_ids=torch.zeros(TOKENS, 3))


def _images() -> torch.Tensor:
    return torch.randn(B, 3, PIXELS, PIXELS, generator=_gen(5))


def vae_batch() -> dict[str, Any]:
    return dict(sample=_images(), sample_posterior=True, generator=_gen(6))


def noise_loss(output: Any) -> torch.Tensor:
    """The denoiser's prediction against the noise added (epsilon prediction); a model that also learns the
    variance (PixArt-alpha: 2C channels out) has its first C channels compared, as its training scripts do."""
    return F.mse_loss(output.sample[:, :C], _noise())


def flux_loss(output: Any) -> torch.Tensor:
    return F.mse_loss(output.sample, _pack(_noise()))


def reconstruction_loss(output: Any) -> torch.Tensor:
    return F.mse_loss(output.sample, _images())


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """diffusers' own checkpointing (``ModelMixin.enable_gradient_checkpointing``)."""
    model.enable_gradient_checkpointing()


def _entry(name: str, units: tuple[str, ...], batch: Callable[[], dict[str, Any]], loss: Callable[[Any], torch.Tensor],
           make: Callable[[], nn.Module]) -> ZooModel:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().train()

    return ZooModel(name=f"diffusers.{name}", family="diffusion", build=build, batch=batch, loss=loss,
                    own=enable_gradient_checkpointing, units=units)


def models() -> list[ZooModel]:
    """Every diffusers entry; none when ``diffusers`` does not import."""
    try:
        import diffusers as d
    except ImportError:
        return []
    heads = dict(num_attention_heads=2, attention_head_dim=16)  # 2 x 16 = WIDTH
    latent = dict(sample_size=SIDE, patch_size=2, in_channels=C, num_layers=2)
    return [
        # Stable Diffusion 1.x/2.x: diffusers checkpoints each down/up block's resnets and, inside each
        # Transformer2DModel, its BasicTransformerBlocks (not the Transformer2DModel itself)
        _entry("unet2d_condition", ("BasicTransformerBlock", "ResnetBlock2D"), unet_batch, noise_loss,
               lambda: d.UNet2DConditionModel(
                   sample_size=SIDE, in_channels=C, out_channels=C, block_out_channels=(WIDTH, WIDTH),
                   down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                   up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                   cross_attention_dim=WIDTH, attention_head_dim=8, norm_num_groups=8)),
        _entry("dit", ("BasicTransformerBlock",), dit_batch, noise_loss, lambda: d.DiTTransformer2DModel(
            **heads, **latent, num_embeds_ada_norm=10, norm_num_groups=8)),
        # a BasicTransformerBlock holds attn1 and attn2: two numbered modules, not a series of blocks
        _entry("pixart", ("BasicTransformerBlock",), pixart_batch, noise_loss, lambda: d.PixArtTransformer2DModel(
            **heads, **latent, cross_attention_dim=WIDTH, caption_channels=WIDTH, norm_num_groups=8)),
        _entry("sd3", ("JointTransformerBlock",), sd3_batch, noise_loss, lambda: d.SD3Transformer2DModel(
            **heads, **latent, joint_attention_dim=WIDTH, caption_projection_dim=WIDTH, pooled_projection_dim=16,
            out_channels=C, pos_embed_max_size=16)),
        # two stacks: double-stream blocks, then single-stream ones; rotary axes add up to the head dimension
        _entry("flux", ("FluxTransformerBlock", "FluxSingleTransformerBlock"), flux_batch, flux_loss,
               lambda: d.FluxTransformer2DModel(
                   **heads, patch_size=1, in_channels=4 * C, num_layers=2, num_single_layers=2,
                   joint_attention_dim=WIDTH, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))),
        # the Encoder and Decoder checkpoint their down/up blocks and mid block whole (vae.py)
        _entry("autoencoder_kl", ("DownEncoderBlock2D", "UNetMidBlock2D", "UpDecoderBlock2D"), vae_batch,
               reconstruction_loss, lambda: d.AutoencoderKL(
                   in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                   up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(WIDTH, WIDTH), layers_per_block=1,
                   latent_channels=C, norm_num_groups=8, sample_size=PIXELS)),
    ]


__all__ = ["models"]
