"""A small GPT (a stack of ``TransformerBlock``s) as a LightningModule.

    python recipes/train.py                                  # this model, checkpointed
    python recipes/train.py ckpt.layers=TransformerBlock ckpt.every_n=2

Character-level, trained on text that ships with Python (see ``data.py``), so
nothing is downloaded. ``defer_init=True`` builds the layers in
``configure_model`` instead of ``__init__``, as FSDP and DeepSpeed ZeRO-3
users do.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_examples.sharding import shard_blocks
from ckpt_plugin import checkpoint_name


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(checkpoint_name(F.gelu(self.fc(x)), "mlp_hidden")))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tags for ckpt=names (JAX checkpoint_name): identity unless a names policy is active.
        x = x + checkpoint_name(self.attn(self.ln1(x)), "attn_out")
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    def __init__(
        self,
        vocab_size: int = 96,  # printable ASCII; data.py maps text onto it
        block_size: int = 256,  # tokens per sample
        n_layer: int = 12,  # blocks: checkpointing saves more the deeper the stack
        n_head: int = 4,
        n_embd: int = 256,
        dropout: float = 0.1,  # on, so that RNG replay on recompute matters
        lr: float = 3e-4,
        batch_size: int = 8,  # only for example_input_array
        defer_init: bool = False,  # build the layers in configure_model
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(batch_size, block_size, dtype=torch.long)
        if not defer_init:
            self._build()

    def _build(self) -> None:
        h = self.hparams
        self.tok_emb = nn.Embedding(h.vocab_size, h.n_embd)
        self.pos_emb = nn.Embedding(h.block_size, h.n_embd)
        self.drop = nn.Dropout(h.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(h.n_embd, h.n_head, h.dropout) for _ in range(h.n_layer))
        self.ln_f = nn.LayerNorm(h.n_embd)
        self.head = nn.Linear(h.n_embd, h.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * h.n_layer))

    def configure_model(self) -> None:
        if self.hparams.defer_init and not hasattr(self, "blocks"):
            self._build()
        if self.device_mesh is not None:  # trainer=model_parallel: shard with FSDP2, block by block
            shard_blocks(self, self.blocks, self.device_mesh)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
