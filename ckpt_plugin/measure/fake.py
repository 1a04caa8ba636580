"""Measuring without allocating: the plugin's own measurements run on fake tensors.

The plugin exists because the step without checkpointing does not fit; what
it measures for itself (the fit-start report, ``ckpt=auto``'s profile,
``ckpt-inspect``) must therefore never run that step on real tensors. Bytes
and FLOPs depend only on shapes, dtypes and devices, which fake tensors carry
exactly: inside :func:`on_fake_tensors` every op makes a fake tensor whose
storage has the real size, nothing is allocated and no kernel runs, so the
counts equal a real run's (``tests/test_fake.py`` compares them on the GPT,
the ResNet and Hugging Face models) for a few hundred KiB of Python objects,
whatever the batch (``shared/notes/fake-tensors.md``).

The model runs as it is: its real parameters, buffers and sample batch are
converted on use. Buffers a forward updates in place (BatchNorm's running
statistics) and the RNG are restored afterwards; gradients that a measured
backward would leave on the parameters (fake ones) are put back as they were.

A forward that reads values (``.item()``, a branch on data, ``nonzero``)
runs too, inside :func:`~ckpt_plugin.measure.values.with_values_replayed`: the
fake run replays what a real forward without autograd read
(``measure/values.py``). What still cannot run on fake tensors raises
:class:`NotFakeable`, naming the model, the op and where, so that the caller
can say what it skipped, or refuse.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import fake_read_error, fake_tensor_mode, is_fake, raised_by_fake_tensors
from ckpt_plugin.measure.memory import side_effect_free
from ckpt_plugin.measure.values import UnreplayableRead, active_replay


class NotFakeable(RuntimeError):
    """The model's forward cannot run on fake tensors (it reads values, not only shapes).

    ``reads_values``: it stopped on a read that a recorded forward may answer
    (``measure/values.py``), not on an op fake tensors cannot run at all.
    """

    def __init__(self, message: str, reads_values: bool = False) -> None:
        super().__init__(message)
        self.reads_values = reads_values


@contextlib.contextmanager
def fake_measurement(model: nn.Module, what: str) -> Iterator[Any]:
    """A fake-tensor mode for measuring ``model``, not entered: the caller enters it where it needs.

    On exit the parameters' ``.grad`` are as they were (a measured backward
    leaves fake ones), so is every plain attribute of its modules that the
    measurement set to a fake tensor (a cache a forward fills lazily, as
    Lightning's demo ``PositionalEncoding.pe`` or a rotary table: left fake,
    the next real step would compute on it), and an error that fake tensors caused becomes
    :class:`NotFakeable`; ``what`` (``"ckpt=auto's profile"``) says in it what
    was being measured. Buffers and RNG are the caller's: see :func:`on_fake_tensors`.
    """
    grads = {p: p.grad for p in model.parameters()}
    attributes = [(m, dict(vars(m))) for m in model.modules()]
    try:
        # What the user compiled (a layer's ``Module.compile()``, a compiled child) runs eagerly here:
        # dynamo does not trace under a dispatch mode (with fullgraph=True it raises), and a graph of
        # fake tensors would be one real tensors never use.
        with _heap_set_aside(), torch.compiler.set_stance("force_eager"):
            yield fake_tensor_mode(active_replay(model))
    except (NotImplementedError, RuntimeError) as err:
        if isinstance(err, NotFakeable) or not _from_fake_tensors(err):
            raise
        unmet = next((e for e in _chain(err) if isinstance(e, UnreplayableRead)), None)
        first = str(unmet or err).strip().splitlines()[0] if str(unmet or err).strip() else ""
        raise NotFakeable(
            f"{what} runs {type(model).__name__} on fake tensors (shapes only, no memory) and its forward "
            f"cannot run on them: {type(unmet or err).__name__}: {first}",
            reads_values=unmet is None and any(fake_read_error(e) for e in _chain(err)),
        ) from err
    finally:
        for p, g in grads.items():
            p.grad = g
        _restore_fake_attributes(attributes)


@contextlib.contextmanager
def _heap_set_aside() -> Iterator[None]:
    """The objects alive on entry left out of the garbage collector's passes until exit (``gc.freeze``).

    A measurement makes many Python objects (fake tensors, their metadata), and each of the
    collector's full passes that they trigger walks every object of the process: torch's,
    Lightning's, transformers' modules; 2-3 s a pass in a test process here, a quarter of a
    zoo plan's time. Nothing is collected the less: what the measurement leaves behind is
    collected as always, and the rest goes back (``gc.unfreeze``) as it was. A process that
    froze its heap itself, or runs without the collector, is left as it is.
    """
    global _set_aside
    # Inside one already (measurements nest): nothing to do. Not asked of get_freeze_count(), which walks every frozen
    # object (0.16 s for a test process's 450,000); outside one it counts what the process froze itself: mostly none.
    if _set_aside or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _set_aside = True
    try:
        yield
    finally:
        _set_aside = False
        gc.unfreeze()


_set_aside = False  # whether _heap_set_aside froze the heap (and is still inside)


def _restore_fake_attributes(attributes: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Put back each module attribute that now holds a fake tensor (directly or in a tuple or list) as it was."""
    for module, before in attributes:
        for name, value in list(vars(module).items()):
            if value is before.get(name, _ABSENT) or not any(is_fake(v) for v in _leaves(value)):
                continue
            if name in before:
                setattr(module, name, before[name])
            else:
                delattr(module, name)


_ABSENT = object()


def _leaves(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


@contextlib.contextmanager
def on_fake_tensors(model: nn.Module, what: str) -> Iterator[None]:
    """Run ``model`` inside on fake tensors, leaving no trace on it (buffers, RNG, ``.grad``)."""
    with fake_measurement(model, what) as mode, side_effect_free(model), mode:
        yield


def _from_fake_tensors(err: BaseException) -> bool:
    """Raised because the tensors were fake (a data-dependent op, an op without a fake kernel)."""
    return any(raised_by_fake_tensors(e) or isinstance(e, UnreplayableRead) for e in _chain(err))


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


__all__ = ["NotFakeable", "fake_measurement", "on_fake_tensors"]
