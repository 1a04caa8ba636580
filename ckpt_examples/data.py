"""Data for the embedded examples, made on the spot: nothing is downloaded.

- ``TextData``: windows of characters of ``corpus.txt`` (shipped in the package)
  for the GPT, next-character targets.
- ``ImageData``: images of ``num_classes`` fixed random patterns plus noise for
  the ResNet, so the loss can fall.

Both hand out a ``ResumableDataLoader``: a run resumed from a mid-epoch
checkpoint (``ckpt_path=last``) goes on from the batch after the saved step.
"""

from __future__ import annotations

from importlib.resources import files

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset, TensorDataset

from ckpt_plugin import ResumableDataLoader

VOCAB_SIZE = 96  # '\n' -> 0, printable ASCII ' '..'~' -> 1..95


def encode(text: str) -> torch.Tensor:
    codes = [0 if c == "\n" else ord(c) - 31 for c in text if c == "\n" or " " <= c <= "~"]
    return torch.tensor(codes, dtype=torch.long)


class _Windows(Dataset):
    def __init__(self, tokens: torch.Tensor, block_size: int, num_samples: int) -> None:
        if len(tokens) <= block_size + 1:
            raise ValueError(
                f"data.block_size={block_size} needs more than {block_size + 1} tokens; the corpus has {len(tokens)}"
            )
        self.tokens, self.block_size, self.num_samples = tokens, block_size, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (i * 7919) % (len(self.tokens) - self.block_size - 1)  # a prime stride spreads windows
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class TextData(pl.LightningDataModule):
    def __init__(self, block_size: int = 256, batch_size: int = 8, num_samples: int = 4096) -> None:
        super().__init__()
        self.block_size, self.batch_size, self.num_samples = block_size, batch_size, num_samples

    def train_dataloader(self) -> ResumableDataLoader:
        text = files("ckpt_examples").joinpath("corpus.txt").read_text(encoding="utf-8")
        windows = _Windows(encode(text), self.block_size, self.num_samples)
        return ResumableDataLoader(windows, batch_size=self.batch_size)


class ImageData(pl.LightningDataModule):
    def __init__(
        self, image_size: int = 32, num_classes: int = 10, batch_size: int = 16, num_samples: int = 512, seed: int = 0
    ) -> None:
        super().__init__()
        self.image_size, self.num_classes = image_size, num_classes
        self.batch_size, self.num_samples, self.seed = batch_size, num_samples, seed

    def train_dataloader(self) -> ResumableDataLoader:
        g = torch.Generator().manual_seed(self.seed)
        patterns = torch.randn(self.num_classes, 3, self.image_size, self.image_size, generator=g)
        labels = torch.randint(self.num_classes, (self.num_samples,), generator=g)
        images = patterns[labels] + 0.5 * torch.randn(self.num_samples, 3, self.image_size, self.image_size, generator=g)
        return ResumableDataLoader(TensorDataset(images, labels), batch_size=self.batch_size)
