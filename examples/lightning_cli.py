"""Activation checkpointing under LightningCLI: the callback comes from the config, the model knows nothing of it.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --trainer.callbacks+=ckpt_plugin.ActivationCheckpointing \
        --trainer.callbacks.layers=Block --trainer.callbacks.every_n=2 --trainer.max_steps=2
    python examples/lightning_cli.py fit --trainer.callbacks.help ckpt_plugin.ActivationCheckpointing
"""

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C) -> (B, C)
        return x + self.mlp(self.norm(x))


class Model(pl.LightningModule):
    def __init__(self, width: int = 32, depth: int = 4, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))  # blocks.0 .. blocks.3
        self.head = nn.Linear(width, 1)
        self.example_input_array = torch.zeros(8, width)  # the callback reports the bytes it saves on it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C) -> (B, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class RandomData(pl.LightningDataModule):
    def __init__(self, width: int = 32, size: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.width, self.size, self.batch_size = width, size, batch_size

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(self.size, self.width, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=self.batch_size)


if __name__ == "__main__":
    # overwrite: with logger: false, LightningCLI writes its config.yaml to the working directory.
    LightningCLI(Model, RandomData, save_config_kwargs={"overwrite": True})
