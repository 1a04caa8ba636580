"""Checkpoints that are either complete or absent: write under a temporary name, flush, rename.

A process killed while it writes (SIGKILL at the end of a preemption's grace
time, a node that dies) must leave the previous checkpoint loadable and nothing
half-written under a name a resume would take. POSIX ``rename`` within one
directory replaces a name in one step, for a file and for an empty-or-absent
directory alike, so the recipe is: write ``.<name>.partial`` beside the final
name, ``fsync`` what was written, ``os.replace`` it onto the final name, then
``fsync`` the directory so that the rename itself survives a crash.

Lightning's own ``_atomic_save`` writes through an fsspec transaction whose
temporary file lies in the system's temp directory; where that is another file
system than the checkpoint's (node-local ``/tmp``, a shared ``/scratch``) the
final "move" is a copy, and a kill during the copy leaves a truncated file under
the final name. :class:`AtomicCheckpointIO` puts the temporary file beside the
final one instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "atomic_path", "is_partial", "partial_path", "publish", "remove_path"]

PARTIAL_SUFFIX = ".partial"


def partial_path(final: Path) -> Path:
    """Where ``final`` is written before it is complete: hidden, so no glob for ``*.ckpt`` or ``hpc_ckpt_*`` meets it."""
    return final.with_name(f".{final.name}{PARTIAL_SUFFIX}")


def is_partial(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(PARTIAL_SUFFIX)


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree, if there is one (a killed write's remains, a superseded checkpoint)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` (or ``path`` itself) and every directory, children first."""
    if path.is_dir():
        for root, _, names in os.walk(path, topdown=False):
            for name in names:
                _fsync(Path(root) / name)
            _fsync(Path(root))
    else:
        _fsync(path)


def publish(partial: Path, final: Path) -> None:
    """Make a completely written ``partial`` (file or directory) appear as ``final`` in one step.

    A directory can only replace an absent name, so a previous ``final`` directory
    is first moved aside under another partial name (still not a name a resume
    takes) and deleted once the new one is in place.
    """
    _fsync_tree(partial)
    old = None
    if final.is_dir() and not final.is_symlink():
        old = final.with_name(f".{final.name}.old{PARTIAL_SUFFIX}")
        remove_path(old)
        os.replace(final, old)
    os.replace(partial, final)
    _fsync(final.parent)
    if old is not None:
        remove_path(old)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield the partial path to write ``final`` into; publish it if the block ends without an exception.

    >>> with atomic_path(Path("ckpts/last.ckpt")) as tmp:
    ...     torch.save(state, tmp)

    One process writes, one publishes: for a checkpoint that several ranks write
    together (a sharded directory), call :func:`partial_path` and :func:`publish`
    yourself, with a barrier between, as ``preemption.Preemption`` does.
    """
    partial = partial_path(final)
    remove_path(partial)  # a previous writer's remains
    try:
        yield partial
    except BaseException:
        remove_path(partial)
        raise
    publish(partial, final)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with the temporary file beside the checkpoint, flushed before the rename.

    >>> Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])

    Every file a ``ModelCheckpoint`` or ``trainer.save_checkpoint`` writes through
    the strategy's checkpoint IO (single device, DDP, FSDP full state dicts) is
    then complete or absent. Remote paths (``s3://``...) keep Lightning's own
    transaction, which object stores already make atomic.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; "
                "it takes none (as TorchCheckpointIO)"
            )
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path)
            return
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(final) as partial, open(partial, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
