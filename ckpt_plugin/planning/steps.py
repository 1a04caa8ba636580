"""One training step of the model with its candidates under given options, recorded (``recorder.py``).

Every measurement ``ckpt=auto`` plans from is such a step, on fake tensors
(``measure/fake.py``) or, for tests, real ones: the layers under ``keep``,
``selective`` or ``full`` in turn (``profile.py``), their parts likewise
(``parts.py``), a plan's choices to check its peak. Each layer runs through a
recorder's window and, under an option that checkpoints, a
``CheckpointedForward``, installed for the step only (``engine/forwards.py``'s
``TemporaryForwards``): the model is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ckpt_plugin._compat import tree_leaves
from ckpt_plugin.engine.forwards import TemporaryForwards
from ckpt_plugin.engine.selective.policies import SavedOutputModified, make_policy
from ckpt_plugin.engine.treatment import Treatment
from ckpt_plugin.engine.wrap import CheckpointedForward
from ckpt_plugin.measure.memory import side_effect_free
from ckpt_plugin.planning.options import KEEP, Option
from ckpt_plugin.planning.recorder import Recorder

log = logging.getLogger("ckpt_plugin")


def treatment(option: Option, preserve_rng_state: bool = True) -> Treatment | None:
    """How a layer runs under ``option``: None where the layer itself is neither checkpointed nor offloaded
    (``keep``; ``inside``, whose parts are): leave it unwrapped."""
    if not option.checkpoints:
        return Treatment(checkpointing=False, offload=True) if option.offload else None
    policy = make_policy(option.policy) if option.policy is not None else None
    return Treatment(checkpointing=True, preserve_rng_state=preserve_rng_state, policy=policy, offload=option.offload)


def recorded_step(model: nn.Module, names: list[str], forward: Callable[[], Any],
                  option: Option | Mapping[str, Option], *,
                  fake: Any = None, around: list[str] = ()) -> Recorder:
    """One training step with every candidate under ``option``, recorded; the model is left as it was.

    ``option`` may map each name to its own (a plan's choices: nested names are
    nested checkpoints; ``inside`` leaves the module unwrapped, as ``keep``).

    Memory and FLOPs come from the same step: the recorder counts each op's FLOPs
    as FlopCounterMode does (``_compat.op_flops``, its registry), not through
    FlopCounterMode itself, whose module tracker holds recomputed tensors until
    backward ends (multi-grad hooks on module outputs) and would distort the
    memory timeline. ``around``: modules recorded as windows too, unwrapped (the
    layers that ``names``, their parts, sit in; ``inside.py``).
    """
    modules = dict(model.named_modules())
    chosen = dict.fromkeys(names, option) if isinstance(option, Option) else option
    how = {o: treatment(o) or Treatment(checkpointing=False) for o in set(chosen.values())}
    recorder = Recorder(model, fake)
    recorder.counter = mode = recorder
    grads = {p: p.grad for p in model.parameters()}
    with TemporaryForwards() as forwards:
        try:
            for name in around:
                forwards.replace(modules[name], recorder.window(name, modules[name].forward))
            for name in names:
                module = modules[name]
                # Labelled inside checkpoint (its recomputation runs the inner forward only) and
                # outside it (checkpoint saves the layer's inputs before calling the inner forward).
                # A part (``around`` given) left unwrapped keeps of its inputs what its ops save: with the
                # rule above for its layer's inputs, a tensor is never counted less than it is kept.
                inputs = not around or how[chosen[name]].checkpointing
                forwards.replace(module, recorder.window(name, module.forward, inputs))
                checkpointed = CheckpointedForward(module, how[chosen[name]], name)  # around the inner window
                forwards.replace(module, recorder.window(name, checkpointed, inputs))
            with side_effect_free(model), fake or contextlib.nullcontext(), mode, torch.enable_grad():
                with torch.autograd.graph.saved_tensors_hooks(recorder.keep, lambda t: t):
                    outputs = [t for t in tree_leaves(forward()) if isinstance(t, torch.Tensor) and t.requires_grad]
                    if not outputs:
                        raise ValueError("ckpt=auto: the profiling forward returned no tensor that requires grad; "
                                         "it must return the loss")
                    # Made before backward, as loss.backward() makes its own: MemTracker counts it as act.
                    seeds = [torch.ones_like(t) for t in outputs]
                recorder.counting = False
                recorder.backward_at = len(recorder.events)
                torch.autograd.backward(outputs, seeds)
                del outputs, seeds
        finally:
            for p, g in grads.items():  # the step's gradients are dropped
                p.grad = g
    return recorder


def step_where_it_runs(model: nn.Module, names: list[str], forward: Callable[[], Any], option: Option,
                       mode: Any, around: list[str] = ()) -> tuple[Recorder, set[str]]:
    """:func:`recorded_step` with every candidate under ``option`` that can run under it; the others, kept.

    A selective policy cannot run where an output it saves is written in place after the
    layer returned it (``policies.SavedOutputModified``: a parent's ``x.mul_(scale)`` on a
    layer ending in a linear; writes inside the layer are copied before, ``engine/selective/policies.py``):
    the step names the first such layer, and every candidate of its class runs ``keep`` in
    a step again (one class runs one forward). Returns the recorder and the layers left out.
    ``around``: as for :func:`recorded_step` (the candidates are parts of layers).
    """
    modules = dict(model.named_modules())
    chosen = dict.fromkeys(names, option)
    while True:
        try:
            return (recorded_step(model, names, forward, chosen, fake=mode, around=around),
                    {n for n, o in chosen.items() if o != option})
        except SavedOutputModified as err:
            if err.module not in chosen or chosen[err.module] != option:
                raise
            cls = type(modules[err.module])
            chosen |= {n: KEEP for n in names if type(modules[n]) is cls}
            log.debug("ckpt=auto: no %s for %s layers: %s", option, cls.__name__, err)


__all__ = ["recorded_step", "step_where_it_runs", "treatment"]
