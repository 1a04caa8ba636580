"""Wrap and unwrap modules with non-reentrant activation checkpointing.

A selected module keeps its place, its class and its name: we set an
instance-level ``forward`` that runs the class's own forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. ``nn.Module``
looks ``forward`` up on the instance first, so hooks, ``state_dict`` keys and
``named_parameters`` stay exactly as they were, unlike torch's
``checkpoint_wrapper``, which inserts ``_checkpoint_wrapped_module`` into every
key (pytorch#117399, pytorch#108269). Removing the attribute restores the
module exactly.

Recomputation replays the forward, and a BatchNorm in training mode would
update its running statistics a second time (pytorch#96136, open upstream).
The recompute context below snapshots every running-statistics buffer in the
wrapped subtree and writes it back afterwards, so statistics match a run
without checkpointing bit for bit.

The recomputation must save what the forward saved; if it does not, the
error names the module (``recompute_check.py``), which torch's does not.

Under ``torch.compile``: apply, then compile, or compile, then apply. The
compiled code runs whatever ``forward`` each module has when it is traced,
and dynamo guards on it, so applying or removing after a compiled run
recompiles (``tests/test_compile.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from . import deepspeed_ckpt
from ._compat import checkpoint_debug_enabled, uncompiled
from .chain import ATTR, ChainCheckpoint, chains_of, check_consecutive
from .config import CkptConfig, make_config, raise_problems
from .norms import running_stats
from .selection import select_layers
from .sequential import schedule
from .treatment import Treatment

class CheckpointedForward:
    """The instance-level ``forward`` of a wrapped module.

    ``inner`` is the forward the module had before (its class's, or an
    instance-level one somebody else set, which ``remove`` puts back).
    ``name`` is the module's qualified name, for errors: a recomputation that
    saves something other than its forward did is reported with it
    (``recompute_check.py``).
    """

    __slots__ = ("inner", "previous", "treatment", "name", "_context_fn", "_check_only", "_stats")

    def __init__(self, module: nn.Module, treatment: Treatment, name: str | None = None) -> None:
        self.previous = module.__dict__.get("forward")  # None: the class's forward
        self.inner: Callable[..., Any] = module.forward
        self.treatment = treatment
        self.name = name
        label = f"{name} ({type(module).__name__})" if name else f"a {type(module).__name__}"
        self._stats = running_stats(module)
        self._context_fn = treatment.context_fn(self._stats, label)
        self._check_only = treatment.policy is None and not self._stats  # context_fn only checks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = self.treatment
        with t.offloading():  # outside checkpoint: offloads what checkpointing still keeps
            if not t.checkpointing:
                return self.inner(*args, **kwargs)
            if t.deepspeed is not None:
                return deepspeed_ckpt.checkpointed_call(self.inner, self._stats, *args, **kwargs)
            # kwargs travel in a partial so that a forward argument can never
            # collide with checkpoint's own keywords (``context_fn``, ...).
            fn = functools.partial(self.inner, **kwargs) if kwargs else self.inner
            context_fn = self._context_fn
            if self._check_only and checkpoint_debug_enabled():
                # torch's debug mode refuses a context_fn and prints every op of both runs
                # on a mismatch: it replaces our check rather than fail.
                context_fn = None
            options = {"context_fn": context_fn} if context_fn else {}
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=t.preserve_rng_state, **options)


def wrapped_modules(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that this plugin has wrapped."""
    model = uncompiled(model)
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), CheckpointedForward) or ATTR in m.__dict__
    ]


def policy_of(model: nn.Module) -> Any:
    """The selective policy the wrapped modules of ``model`` share, or None."""
    treatments = [m.__dict__["forward"].treatment for m in model.modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]
    treatments += [chain.treatment for chain in chains_of(model)]
    return next((t.policy for t in treatments if t.policy is not None), None)


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo :func:`apply_checkpointing`: every wrapped module gets its forward back.

    Returns the qualified names that were unwrapped. Safe on a model that was
    never wrapped.
    """
    model = uncompiled(model)
    removed = wrapped_modules(model)
    for chain in chains_of(model):
        chain.remove()
    for module in model.modules():
        wrapper = module.__dict__.get("forward")
        if isinstance(wrapper, CheckpointedForward):
            if wrapper.previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = wrapper.previous
    return removed


def apply_config(model: nn.Module, config: CkptConfig, forward: Callable[[], Any] | None = None) -> list[str]:
    """Wrap the modules ``config`` selects; see :func:`apply_checkpointing`.

    ``forward()`` runs the model on a sample input (``ckpt=auto`` profiles with
    it); by default ``model(model.example_input_array)``. ``model`` may be
    ``torch.compile(model)``: its modules are wrapped, under their own names.
    """
    model = uncompiled(model)
    if config.mode == "none":
        remove_checkpointing(model)
        return []
    if config.mode == "auto":
        return _apply_auto(model, config, forward or _example_forward(model))
    # Check everything against the model before touching it: an error leaves
    # the model exactly as it was (wrapped or not).
    names = select_layers(model, config)
    segments = getattr(config, "segments", None)
    if segments is not None:
        if config.every_n != 1:
            raise ValueError(
                f"ckpt.segments={segments} cannot be combined with ckpt.every_n={config.every_n}: "
                "segments group consecutive layers; drop one of the two"
            )
        raise_problems(check_consecutive(model, names), "ckpt.segments")
        schedule(len(names), segments)  # raises if segments > len(names)
    treatment = Treatment.of(config)
    remove_checkpointing(model)
    modules = dict(model.named_modules())
    if segments is not None:
        ChainCheckpoint(names, [modules[n] for n in names], segments, treatment)
    else:
        for name in names:
            module = modules[name]
            module.__dict__["forward"] = CheckpointedForward(module, treatment, name)
    return names


def _apply_auto(model: nn.Module, config: CkptConfig, forward: Callable[[], Any]) -> list[str]:
    from .auto import apply_plan, parse_budget, profile, resolve

    names = select_layers(model, config)
    measured = profile(model, names, lambda: _scalar(forward()))
    chosen = measured.plan(resolve(parse_budget(config.budget), measured.no_ckpt_peak))  # raises if it cannot fit
    rank_zero_info(f"ckpt=auto plan:\n{chosen}")
    return apply_plan(model, chosen, config.preserve_rng_state)


def _example_forward(model: nn.Module) -> Callable[[], Any]:
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ValueError(
            f"ckpt=auto profiles the layers on a sample input: set `example_input_array` on "
            f"{type(model).__name__} (Lightning's convention: a tensor, a tuple of arguments or a dict)"
        )
    args, kwargs = call_args(example)
    return lambda: model(*args, **kwargs)


def call_args(example: Any) -> tuple[tuple, dict]:
    """Lightning's convention for ``example_input_array`` (as in ModelSummary): a tuple is
    the positional arguments, a dict the keyword arguments, anything else the one argument."""
    if isinstance(example, tuple):
        return example, {}
    if isinstance(example, dict):
        return (), example
    return (example,), {}


def _scalar(output: Any) -> Any:
    """A loss to backpropagate from any forward output: the sum of its floating-point tensors."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    parts = [t.float().sum() for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.stack(parts).sum()


def apply_checkpointing(model: nn.Module, **ckpt_keys: Any) -> list[str]:
    """Checkpoint the layers of ``model`` named by the keys of the ``ckpt`` node.

    >>> apply_checkpointing(gpt, layers="TransformerBlock")
    ['blocks.0', 'blocks.1', ...]

    Returns the qualified names wrapped, in model order. Applying again replaces
    the previous wrapping (never wraps twice); ``mode="none"`` unwraps.
    """
    return apply_config(model, make_config(**ckpt_keys))


@contextlib.contextmanager
def checkpointing_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as if it were not wrapped, then put the very same wrappers back."""
    wrappers = {
        m: m.__dict__["forward"]
        for m in model.modules()
        if isinstance(m.__dict__.get("forward"), CheckpointedForward)
    }
    for m in wrappers:
        del m.__dict__["forward"]
    with contextlib.ExitStack() as stack:
        for chain in chains_of(model):
            stack.enter_context(chain.paused())
        try:
            yield
        finally:
            for m, wrapper in wrappers.items():
                m.__dict__["forward"] = wrapper
