"""The recurrence both scan test files run: a tanh cell on a (BATCH, DIM) carry, its weights, its first carry."""

from __future__ import annotations

import torch
from torch import nn

BATCH, DIM = 4, 16  # carry (BATCH, DIM)


def step(carry: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.tanh(carry @ weight + bias)  # (BATCH, DIM)


def dropout_step(carry: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(step(carry, weight, bias), p=0.2, training=True)


class Cell(nn.Module):
    """Holds the weights of ``step`` as parameters, so that the measuring helpers can exclude them."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(DIM, DIM, generator=g, dtype=dtype) / DIM**0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(DIM, generator=g, dtype=dtype))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight, self.bias

    def forward(self, carry: torch.Tensor) -> torch.Tensor:
        return step(carry, self.weight, self.bias)


def make_init(dtype: torch.dtype = torch.float32, requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g, dtype=dtype).requires_grad_(requires_grad)
