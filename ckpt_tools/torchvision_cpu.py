"""torchvision's Python parts on a torch its compiled ops were not built for: what timm (and Lightning) need.

The registry's torchvision 0.28.0 (torch 2.13.0's companion) is a CUDA build: its
``_C.so`` links ``libc10_cuda.so`` and ``libtorch_cuda.so``, which the CPU torch
lacks. ``torchvision.extension`` notices (``_has_ops()`` is False; it says why under
``TORCHVISION_WARN_WHEN_EXTENSION_LOADING_FAILS=1``) and goes on, and most of
``torchvision._meta_registrations`` checks ``_has_ops()`` before registering. Two of
its registrations do not, so the import stops there::

    @torch.library.register_fake("torchvision::nms")     # and "torchvision::qnms"
    RuntimeError: operator torchvision::nms does not exist

With it stop ``import timm`` (``timm.layers`` imports ``torchvision.ops.misc``) and,
in an environment that has torchvision at all, ``import lightning.pytorch``
(torchmetrics imports torchvision whenever it is installed).

:func:`install` puts a hook on ``sys.meta_path`` that runs that one module with
``torch.library.register_fake`` skipping an operator that ``torchvision::`` does
not have: exactly the two above when the ops did not load, none when they did
(a torchvision built for this torch), and any other error raised as it was. Nothing
on disk changes, and torchvision's ops still refuse to run with its own message
("Couldn't load custom C++ ops"); its models, which are pure Python, work. The
hook costs nothing until torchvision is imported.

It is installed where this project's own processes start: ``ckpt_tools``'s
``__init__`` (its commands, the zoo, ``latest_deps`` in CI), ``tests/conftest.py``
and the test suite's warm interpreter (``tests/warm_python.py``'s preload). The
library itself (``ckpt_plugin``) never installs it: a user's environment is theirs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

__all__ = ["SKIPPED", "install"]

TARGET = "torchvision._meta_registrations"  # the module whose import registers fakes of ops that may be missing
SKIPPED: list[str] = []  # the operators whose fake registration was skipped, in this process (for the tests)


@contextmanager
def _missing_ops_skipped() -> Iterator[None]:
    """``torch.library.register_fake`` that passes over a ``torchvision::`` operator torch does not have."""
    import torch.library

    real = torch.library.register_fake

    def register_fake(op, func=None, /, **kwargs):  # torch.library.register_fake's signature
        def register(fn):
            try:
                return real(op, fn, **kwargs)
            except RuntimeError as err:
                if not (isinstance(op, str) and op.startswith("torchvision::") and "does not exist" in str(err)):
                    raise
                SKIPPED.append(op)
                return fn

        return register if func is None else register(func)

    torch.library.register_fake = register_fake
    try:
        yield
    finally:
        torch.library.register_fake = real


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _missing_ops_skipped():
            self.loader.exec_module(module)

    def __getattr__(self, name: str):  # get_source, get_filename...: the file's own loader answers
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Make ``import torchvision`` work where its compiled ops do not load (see the module's docstring); idempotent."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
