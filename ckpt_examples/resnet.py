"""A small ResNet with BatchNorm: stages (``ResStage``) of ``Bottleneck`` blocks.

    python recipes/train.py model=resnet ckpt.layers=ResStage
    python recipes/train.py model=resnet ckpt.layers=Bottleneck ckpt.every_n=2

BatchNorm is what makes this example matter: recomputing a block in training
mode would update its running statistics twice (pytorch#96136).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_examples.sharding import shard_blocks


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand, each with BatchNorm; dropout on the residual branch."""

    def __init__(self, channels: int, stride: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        mid = channels // 4
        self.conv1 = nn.Conv2d(channels, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout2d(dropout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels))
            if stride != 1
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.drop(self.bn3(self.conv3(out)))
        return F.relu(out + self.shortcut(x))


class ResStage(nn.Sequential):
    """Blocks at one resolution; the first may downsample."""

    def __init__(self, channels: int, depth: int, stride: int, dropout: float) -> None:
        super().__init__(*(Bottleneck(channels, stride if i == 0 else 1, dropout) for i in range(depth)))


class ResNet(pl.LightningModule):
    def __init__(
        self,
        num_classes: int = 10,
        channels: int = 64,  # width of every stage (kept constant for simplicity)
        depths: tuple[int, ...] = (2, 2, 2),  # blocks per stage
        image_size: int = 32,
        dropout: float = 0.1,  # on, so that RNG replay on recompute matters
        lr: float = 1e-3,
        batch_size: int = 16,  # only for example_input_array
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(batch_size, 3, image_size, image_size)
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.stages = nn.Sequential(
            *(ResStage(channels, d, 1 if i == 0 else 2, dropout) for i, d in enumerate(depths))
        )
        self.fc = nn.Linear(channels, num_classes)

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # trainer=model_parallel: shard with FSDP2, Bottleneck by Bottleneck
            shard_blocks(self, [block for stage in self.stages for block in stage], self.device_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, C, H', W')
        return self.fc(x.mean(dim=(2, 3)))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
