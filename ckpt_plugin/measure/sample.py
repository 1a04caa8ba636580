"""Running a model on its sample input, the way the report and ``ckpt=auto`` need it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import tree_leaves


def call_args(example: Any) -> tuple[tuple, dict]:
    """Lightning's convention for ``example_input_array`` (as in ModelSummary): a tuple is
    the positional arguments, a dict the keyword arguments, anything else the one argument."""
    if isinstance(example, tuple):
        return example, {}
    if isinstance(example, dict):
        return (), example
    return (example,), {}


def example_forward(model: nn.Module) -> Callable[[], Any]:
    """``model(example_input_array)``, for a model that has one; a clear error otherwise."""
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ValueError(
            f"ckpt=auto profiles the layers on a sample input: set `example_input_array` on "
            f"{type(model).__name__} (Lightning's convention: a tensor, a tuple of arguments or a dict)"
        )
    args, kwargs = call_args(example)
    return lambda: model(*args, **kwargs)


def scalar(output: Any) -> Any:
    """A loss to backpropagate from any forward output: the sum of its floating-point tensors."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    parts = [t.float().sum() for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.stack(parts).sum()


__all__ = ["call_args", "example_forward", "scalar"]
