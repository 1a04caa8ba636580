"""Activation checkpointing in a plain PyTorch loop: no Lightning, no Hydra.

    python examples/plain_pytorch.py
"""

import torch
from torch import nn

from ckpt_plugin import apply_checkpointing


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


torch.manual_seed(0)
model = Net()
print("checkpointed:", apply_checkpointing(model, layers="auto"))  # the ModuleList's Blocks: blocks.0 ... blocks.5
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 32, 64), torch.randn(8, 32, 1)
for step in range(5):
    loss = nn.functional.mse_loss(model(x), y)  # each Block's forward runs again in backward
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
