"""Data for the embedded examples, made on the spot: nothing is downloaded.

- ``TextData``: windows of characters of ``corpus.txt`` (shipped in the package)
  for the GPT, next-character targets.
- ``ImageData``: images of ``num_classes`` fixed random patterns plus noise for
  the ResNet, so the loss can fall.

Both hand out torchdata's ``StatefulDataLoader`` (``EpochAwareDataLoader``), whose
``state_dict`` Lightning's fit loop saves in the checkpoint: a run resumed from a
mid-epoch checkpoint (``ckpt_path=last``) goes on from the batch after the saved
step, with any ``num_workers`` and under DDP with the ``DistributedSampler``
Lightning puts in.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from importlib.resources import files
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

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


def _forkserver() -> multiprocessing.context.BaseContext:
    # Workers are not persistent (resuming needs it): each epoch starts new ones. Forked from a server that has
    # imported this module (Lightning with it), a worker starts in milliseconds; started bare, each one imports
    # Lightning to unpickle the dataset, seconds per worker per epoch (on 2 CPU cores, 26 of a DDP run's 45 s).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # read when the server starts: once per training process
    return context


class EpochAwareDataLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` plus what a Lightning 2.6 resume needs and its state leaves out.

    Lightning builds a resumed run's iterator (``FitLoop.setup_data``) before it sets
    the ``DistributedSampler``'s epoch, and builds no other for that epoch
    (Lightning#21938); torchdata 0.11 draws the sampler's order when the iterator is
    built and keeps no epoch in its state (torchdata#1513). So the state adds:

    - **The sampler's epoch**, set back before the iterator is built. A state saved
      on an epoch's last batch (``every_n_train_steps`` lands there) becomes the
      next epoch's start: torchdata would restore an exhausted iterator, which
      Lightning would run as an empty epoch.
    - **The loader's generator**, which draws each epoch's worker base seed:
      torchdata restores the current epoch's seed, not the generator the next
      epoch's is drawn from.

    Made for the examples: map-style data, shuffled (if at all) by the
    ``DistributedSampler`` Lightning puts in, workers not persistent and started by a
    forkserver (below).
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("shuffle"):
            raise ValueError(
                "EpochAwareDataLoader(shuffle=True) would not resume exactly: torchdata's RandomSampler draws from "
                "the loader's generator too; use shuffle=False (under DDP, Lightning's DistributedSampler shuffles)"
            )
        if kwargs.get("generator") is None:
            # iter() draws the workers' base seed from this generator, else from torch's global one, which a run
            # resumed at an epoch's end would draw before ResumableRNG restores it and the uninterrupted run after:
            # their dropout masks would be one draw apart.
            kwargs["generator"] = torch.Generator().manual_seed(torch.initial_seed())
        if kwargs.get("num_workers", 0) > 0 and kwargs.get("multiprocessing_context") is None:
            # Forked from a training process, which runs threads (a DDP rank's gloo, autograd's), a worker can
            # hang before it starts: Python 3.11's child waits in PyOS_AfterFork_Child for a lock a thread held
            # at the fork (seen once: a resumed DDP run's worker, tests/test_resume.py, 2026-11-27). A forkserver
            # forks them from a process of its own, without those threads.
            kwargs["multiprocessing_context"] = _forkserver()
        super().__init__(dataset, *args, **kwargs)
        self._generator_at_iter = self.generator.get_state()  # before the current iterator drew its base seed

    def _get_iterator(self) -> Any:  # torch's one place where an iterator, and so its base seed, is made
        self._generator_at_iter = self.generator.get_state()
        return super()._get_iterator()

    @property
    def _epoch_sampler(self) -> Any:
        # Lightning takes torchdata's BatchSampler for a custom one and rebuilds it around its DistributedSampler,
        # leaving ``self.sampler`` a SequentialSampler: the sampler whose epoch counts is the batch sampler's.
        return getattr(self.batch_sampler, "sampler", self.sampler)

    def state_dict(self) -> dict[str, Any]:
        epoch = getattr(self._epoch_sampler, "epoch", 0)  # DistributedSampler's, set by Lightning; else no epochs
        # _num_yielded: batches the current iterator has handed out (torch's, which torchdata's iterators count too)
        if self._iterator is not None and self._iterator._num_yielded >= len(self):
            return {"sampler_epoch": epoch + 1, "generator": self.generator.get_state()}  # the next epoch, afresh
        return {"sampler_epoch": epoch, "generator": self._generator_at_iter, "loader": super().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if hasattr(self._epoch_sampler, "set_epoch"):
            self._epoch_sampler.set_epoch(state_dict["sampler_epoch"])
        self.generator.set_state(state_dict["generator"])  # the next iter() draws the saved epoch's base seed again
        super().load_state_dict(state_dict.get("loader", {}))  # {}: a fresh iterator


class TextData(pl.LightningDataModule):
    def __init__(
        self, block_size: int = 256, batch_size: int = 8, num_samples: int = 4096, num_workers: int = 0
    ) -> None:
        super().__init__()
        self.block_size, self.batch_size, self.num_samples = block_size, batch_size, num_samples
        self.num_workers = num_workers

    def train_dataloader(self) -> StatefulDataLoader:
        text = files("ckpt_examples").joinpath("corpus.txt").read_text(encoding="utf-8")
        windows = _Windows(encode(text), self.block_size, self.num_samples)
        return EpochAwareDataLoader(windows, batch_size=self.batch_size, num_workers=self.num_workers)


class ImageData(pl.LightningDataModule):
    def __init__(
        self,
        image_size: int = 32,
        num_classes: int = 10,
        batch_size: int = 16,
        num_samples: int = 512,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.image_size, self.num_classes = image_size, num_classes
        self.batch_size, self.num_samples, self.seed = batch_size, num_samples, seed
        self.num_workers = num_workers

    def train_dataloader(self) -> StatefulDataLoader:
        g = torch.Generator().manual_seed(self.seed)
        patterns = torch.randn(self.num_classes, 3, self.image_size, self.image_size, generator=g)
        labels = torch.randint(self.num_classes, (self.num_samples,), generator=g)
        images = patterns[labels] + 0.5 * torch.randn(self.num_samples, 3, self.image_size, self.image_size, generator=g)
        data = TensorDataset(images, labels)
        return EpochAwareDataLoader(data, batch_size=self.batch_size, num_workers=self.num_workers)
