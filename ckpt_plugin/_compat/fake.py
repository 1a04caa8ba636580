"""Fake tensors (``torch._subclasses``, private): the fake mode measurement runs in, and telling its tensors
and its errors apart."""

from __future__ import annotations

import functools
from typing import Any

import torch


def fake_tensor_mode(replay: Any = None) -> Any:
    """A ``FakeTensorMode`` (private: ``torch._subclasses``) in which real tensors may take part.

    Inside it ops make fake tensors: shapes, dtypes, devices and storage sizes
    are the real ones, nothing is allocated and no kernel runs. Real
    parameters, buffers and inputs are converted on use, so a model and its
    sample batch run as they are. ``replay`` (``measure/values.py``'s ``Replay``)
    answers the ops that read values (:func:`reads_values`) where fake tensors cannot.
    """
    mode = _fake_mode_class()(allow_non_fake_inputs=True)
    mode.replay = replay
    return mode


def active_fake_mode() -> Any:
    """The fake mode in force (``torch._guards``, private), or None on real tensors."""
    from torch._guards import active_fake_mode as active

    return active()


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a real tensor as a model holds it (no subclass)


@functools.cache
def _fake_mode_class() -> type:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    class _FakeTensorMode(FakeTensorMode):
        """torch's fake mode, its cache used by a real model on fake inputs, and ``_grouped_mm`` in every dtype its
        CPU kernel takes.

        Hugging Face's MoE layers (Mixtral, Qwen2-MoE, OLMoE in transformers 5) run their
        experts through ``torch._grouped_mm``, whose CPU kernel takes float32, while its meta
        function (torch 2.13, ``_meta_grouped_mm_common``) checks for bfloat16, as the CUDA
        kernel needs: the fake forward of a float32 MoE raised where the real one runs. The
        output's shape does not depend on the dtype: it is taken from the bfloat16 meta and
        given the inputs' dtype.
        """

        replay: Any = None

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if self.replay is not None and self.replay.reads(func):
                kwargs = kwargs or {}
                return self.replay.answer(func, args, kwargs,
                                          functools.partial(self._dispatch, func, types, args, kwargs), self._empty)
            return self._dispatch(func, types, args, kwargs)

        def _empty(self, answer: Any) -> Any:
            """A fake tensor of a recorded answer's shape, strides, dtype and device (its values: none)."""
            return FakeTensorMode.__torch_dispatch__(
                self, torch.ops.aten.empty_strided.default, (), (answer.shape, answer.stride),
                {"dtype": answer.dtype, "device": answer.device})

        def _dispatch(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            args, kwargs = self._real_made_fake(func, args, kwargs)
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                dtype = args[0].dtype
                cast = tuple(a.to(torch.bfloat16) if i < 2 else a for i, a in enumerate(args))
                return super().__torch_dispatch__(func, types, cast, kwargs).to(dtype)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _real_made_fake(self, func: Any, args: tuple, kwargs: dict | None) -> tuple[tuple, dict | None]:
            """The real tensors among an op's arguments (a model's parameters and buffers) as the fake tensors the
            mode would convert them to anyway (its converter's memo: the same fake every time).

            torch's fake mode caches an op's output metadata by its arguments' (``_cached_dispatch_impl``), but
            passes the cache by for any call with a real tensor in it ("non-fake tensor"): a real model on a fake
            batch, as planning runs it, missed it on every layer, and BatchNorm's decomposition ran in Python
            at every call (9.1 s of a 16.6 s ResNet plan). Converted first, the call is cached as any fake one.
            A call with no fake tensor, or one that changes a real tensor's metadata in place, is left to torch."""
            if torch.Tag.inplace_view in func.tags:
                return args, kwargs
            # An op's tensors sit in its arguments or in one list of them (cat's): looked at without pytree, which
            # cost more than the cache saved on a GPT.
            real = fake = False
            for a in (*args, *(kwargs.values() if kwargs else ())):
                for t in a if isinstance(a, list | tuple) else (a,):
                    if isinstance(t, FakeTensor):
                        fake = True
                    elif type(t) in _PLAIN:
                        real = True
            if not (real and fake):
                return args, kwargs  # all real: torch decides (it may run the op on them, as AdamW's step count)
            converter = self.fake_tensor_converter

            def one(t: Any) -> Any:
                return converter.from_real_tensor(self, t) if type(t) in _PLAIN and t.device.type != "meta" else t

            def each(a: Any) -> Any:
                if isinstance(a, list | tuple):  # an op takes a list or a tuple of tensors, never a subclass of one
                    return list(map(one, a)) if isinstance(a, list) else tuple(map(one, a))
                return one(a)

            return tuple(each(a) for a in args), {k: each(v) for k, v in kwargs.items()} if kwargs else kwargs

    return _FakeTensorMode


# Ops that read their inputs' values, beyond those torch tags (``data_dependent_output``: a number
# from a tensor; ``dynamic_output_shape``: a shape that depends on values, as ``nonzero``'s): a
# tensor's truth (``if mask.any():``) is ``is_nonzero``, untagged.
_READS_UNTAGGED = ("aten::is_nonzero",)


def reads_values(func: Any) -> bool:
    """``func`` (an op overload) answers from its inputs' values: a number, or a shape that depends on them."""
    tags = getattr(func, "tags", ())
    return (torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags
            or func.name() in _READS_UNTAGGED)


def fake_read_error(err: BaseException) -> bool:
    """``err`` is fake tensors' refusal to read a value (a number, or a shape that depends on values)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return isinstance(err, (DataDependentOutputException, DynamicOutputShapeException))


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (its engine's graph task, private)."""
    return torch._C._current_graph_task_id() != -1


def is_fake(t: Any) -> bool:
    """A fake tensor (made under :func:`fake_tensor_mode`), whose data cannot be read."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return isinstance(t, torch.Tensor) and _is_fake(t)


def raised_by_fake_tensors(err: BaseException) -> bool:
    """``err`` comes from fake tensors (``torch._subclasses``: a data-dependent op such as
    ``.item()``, an op without a fake kernel, devices that fake propagation cannot reconcile)."""
    return type(err).__module__.startswith("torch._subclasses") or "FakeTensor" in str(err)
