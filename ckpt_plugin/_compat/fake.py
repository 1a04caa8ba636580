"""Fake tensors (``torch._subclasses``, private): the fake mode measurement runs in, and telling its tensors
and its errors apart."""

from __future__ import annotations

import functools
from typing import Any

import torch


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (private: ``torch._subclasses``) in which real tensors may take part.

    Inside it ops make fake tensors: shapes, dtypes, devices and storage sizes
    are the real ones, nothing is allocated and no kernel runs. Real
    parameters, buffers and inputs are converted on use, so a model and its
    sample batch run as they are.
    """
    return _fake_mode_class()(allow_non_fake_inputs=True)


@functools.cache
def _fake_mode_class() -> type:
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _FakeTensorMode(FakeTensorMode):
        """torch's fake mode, and ``_grouped_mm`` in every dtype its CPU kernel takes.

        Hugging Face's MoE layers (Mixtral, Qwen2-MoE, OLMoE in transformers 5) run their
        experts through ``torch._grouped_mm``, whose CPU kernel takes float32, while its meta
        function (torch 2.13, ``_meta_grouped_mm_common``) checks for bfloat16, as the CUDA
        kernel needs: the fake forward of a float32 MoE raised where the real one runs. The
        output's shape does not depend on the dtype: it is taken from the bfloat16 meta and
        given the inputs' dtype.
        """

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                dtype = args[0].dtype
                cast = tuple(a.to(torch.bfloat16) if i < 2 else a for i, a in enumerate(args))
                return super().__torch_dispatch__(func, types, cast, kwargs).to(dtype)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return _FakeTensorMode


def is_fake(t: Any) -> bool:
    """A fake tensor (made under :func:`fake_tensor_mode`), whose data cannot be read."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(t, torch.Tensor) and _is_fake(t)


def raised_by_fake_tensors(err: BaseException) -> bool:
    """``err`` comes from fake tensors (``torch._subclasses``: a data-dependent op such as
    ``.item()``, an op without a fake kernel, devices that fake propagation cannot reconcile)."""
    return type(err).__module__.startswith("torch._subclasses") or "FakeTensor" in str(err)
