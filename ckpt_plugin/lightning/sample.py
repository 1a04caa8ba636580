"""The sample input of the fit-start report and ``ckpt=auto``'s plan, under Lightning.

    call = sample_call(trainer, pl_module)   # (args, kwargs) for pl_module(*args, **kwargs), or None

``example_input_array`` first, Lightning's convention (as in ModelSummary),
moved to the device and the precision's dtype as the loop moves a batch. For
``ckpt=auto``, which cannot plan without a sample (``from_batch=True``), a
module without one still has the data it trains on: the first batch of the
train dataloader (the datamodule's, the module's own or the one given to
``fit``), prepared as the loop prepares a batch, and handed to
``training_step``, which is stopped where it calls ``self(...)``: what it
passes there is the sample, so the report and the plan are made for the very
call that trains. Nothing of the model runs for it (see :func:`training_call`):
a ``training_step`` that runs a submodule or the parameters first gives no
sample (None), and the caller says what it needs. What ``training_step`` does
before it calls ``self(...)`` runs once more, and is put back
(``measure/contained.py``: a counter it bumps there counts no extra call).

Drawing the batch leaves no trace: the torch, Python and NumPy random states
are put back (a sampler draws its seed from them), so the run trains on the
same batches with and without the plugin (and a random augmentation in
``training_step`` draws the same numbers). The iterator is a fresh one: worker
processes, if any, start and end for it.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.overrides import TorchFunctionMode

from ckpt_plugin._compat import tree_leaves
from ckpt_plugin.measure.contained import contained
from ckpt_plugin.measure.sample import call_args


def sample_call(trainer: pl.Trainer, pl_module: pl.LightningModule, *, from_batch: bool = False
                ) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` of a forward on ``example_input_array``, else (``from_batch``) on the first training
    batch; or None."""
    example = pl_module.example_input_array
    if example is not None:
        # To the device, then to the precision's dtype (64-true), as the loop does with a batch.
        return call_args(trainer.precision_plugin.convert_input(move_data_to_device(example, where_it_runs(pl_module))))
    if not from_batch:
        return None
    with random_state_kept():
        batch = first_batch(trainer, pl_module)
        return None if batch is None else training_call(trainer, pl_module, batch)


def train_dataloader(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The train dataloader(s) ``fit`` will use, from wherever it takes them; None if there are none."""
    source = getattr(trainer.fit_loop, "_data_source", None)  # Lightning's own record of fit's data source
    if source is not None and source.instance is not None:
        return source.dataloader() if source.is_defined() else None
    if trainer.datamodule is not None:
        return trainer.datamodule.train_dataloader()
    return pl_module.train_dataloader() if is_overridden("train_dataloader", pl_module) else None


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Put the torch (CPU and CUDA), Python and NumPy random states back as they were."""
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def first_batch(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The first training batch from a fresh iterator, prepared as the training loop prepares one; or None.

    It draws from the random states (the sampler's seed): :func:`sample_call` puts them back.
    """
    loaders = train_dataloader(trainer, pl_module)
    if loaders is None:
        return None
    iterator = iter(CombinedLoader(loaders, "max_size_cycle"))  # one loader or a collection, as fit takes them
    try:
        batch, _, _ = next(iterator)
    except StopIteration:
        return None
    finally:
        del iterator  # worker processes, if any, end here
    # As the loop: the precision's dtype, on_before_batch_transfer, then to the device the module runs on.
    batch = trainer.precision_plugin.convert_input(batch)
    if hasattr(pl_module, "_on_before_batch_transfer"):  # the module's or the datamodule's hook, as Lightning picks
        batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, device=where_it_runs(pl_module), dataloader_idx=0)


def where_it_runs(pl_module: pl.LightningModule) -> torch.device:
    """Where the module's own tensors are: the device a sample of it must be on to run it now.

    Not ``pl_module.device`` in the setup hook, where FSDP and FSDP2 plan: Lightning sets that to the strategy's
    device before the strategy has moved the module (``trainer/call.py``, ``_call_setup_hook``), and FSDP moves
    it there only when it shards it (the first GPU run: the profile's forward met a batch on cuda:0 and weights on
    the CPU). The fake twin takes the sample to the strategy's device itself (``apply/twin.py``).
    """
    for t in (*pl_module.parameters(), *pl_module.buffers()):
        if t.device.type != "meta":
            return t.device
    return pl_module.device


class _Called(Exception):
    """Raised before the module's forward runs: ``training_step`` called ``self(*args, **kwargs)``."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.call = (args, kwargs)


class _Stopped(Exception):
    """Raised before ``training_step`` runs any part of the model: it did not call ``self(...)`` first."""


class _NoModel(TorchFunctionMode):
    """Stop at the first torch function given a parameter or a buffer of the model (functional model code)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.state = {id(t) for t in (*model.parameters(), *model.buffers())}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(id(t) in self.state for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)):
            raise _Stopped
        return func(*args, **(kwargs or {}))


def training_call(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> tuple[tuple, dict] | None:
    """What ``training_step(batch, 0)`` calls the module with, stopped right there; None if it does otherwise.

    Only ``training_step``'s own preparation of the batch runs (unpacking, slicing, casting: the batch's
    tensors, without grad). The module's call is stopped by a forward pre-hook placed before every other
    (a sharding strategy's gather included), and so is any submodule's, or any function given the
    model's parameters or buffers: no part of the model runs, no collective starts, nothing is logged.
    """

    def called(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Called(args, kwargs)

    def stopped(module: nn.Module, args: tuple) -> None:
        raise _Stopped

    handles = [pl_module.register_forward_pre_hook(called, prepend=True, with_kwargs=True)]
    handles += [m.register_forward_pre_hook(stopped, prepend=True) for m in pl_module.modules() if m is not pl_module]
    try:  # what training_step does before its call (a counter, a random draw) is put back (contained.py)
        with contained(pl_module), torch.no_grad(), _NoModel(pl_module), trainer.precision_plugin.train_step_context():
            pl_module.training_step(batch, 0)
    except _Called as stop:
        return stop.call
    except Exception:  # a submodule first (_Stopped), self.log outside the loop, ...: no sample
        return None
    finally:
        for handle in handles:
            handle.remove()
    return None


__all__ = ["first_batch", "random_state_kept", "sample_call", "train_dataloader", "training_call", "where_it_runs"]
