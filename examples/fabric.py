"""Activation checkpointing with Lightning Fabric: set up, then checkpoint by the module's own names.

    python examples/fabric.py
"""

import torch
from lightning.fabric import Fabric
from torch import nn

from ckpt_plugin import apply_checkpointing, wrapped_modules


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


fabric = Fabric(accelerator="cpu", devices=1)  # <-- accelerator="cuda", devices=N, strategy="ddp"/"fsdp" alike
fabric.seed_everything(0)
model = Net()
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
# Names are the module's own, not the wrapper's (_forward_module.blocks.0): after setup, as before it.
apply_checkpointing(model, layers="blocks.*")
fabric.print("checkpointed:", wrapped_modules(model))
x, y = torch.randn(8, 32, 64), torch.randn(8, 32, 1)
for step in range(5):
    loss = nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)  # each Block's forward runs again here
    optimizer.step()
    optimizer.zero_grad()
    fabric.print(f"step {step}: loss {loss.item():.4f}")
