"""Whether a fixed offload mode's copies can hide behind the step (issue #41, item 3), said once at fit start.

    outlook = offload_outlook(model, config, names, forward)   # the warning's text, or None

``ckpt=offload`` (and ``ckpt=full ckpt.offload=true``) move what every selected
layer keeps, whatever the link can carry. On the one GPU the plugin has met, that
was 21 GB per step against a forward of about 60 ms: 6.3x the step without
checkpointing (docs/gpu.md). Where the copies need more time than the step's
compute, no schedule hides them, and the run should hear it before it pays, with
the plan that offloads only what hides. The numbers are the planner's own
(``planning/offload_plan.py``): the bytes each layer would move (fake tensors),
the layers' times (one at a time) and the link (pinned copies), simulated on two
streams. Where there is no link (a CPU: nothing moves) nothing is measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckpt_plugin.config.schema import CkptConfig, FullConfig, OffloadConfig
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.planning import link as links
from ckpt_plugin.planning.offload_plan import cannot_hide, fixed_timeline
from ckpt_plugin.planning.options import FULL, FULL_OFFLOAD, KEEP, OFFLOAD
from ckpt_plugin.planning.planner import predicted_peak
from ckpt_plugin.planning.profile import profile


def offloaded_option(config: CkptConfig):
    """The option every selected layer runs under in a fixed offload mode (``offload``, ``full+offload``), or None
    (not offloaded; selective or segments, whose offload the timeline does not model)."""
    if isinstance(config, OffloadConfig):
        return OFFLOAD
    if type(config) is FullConfig and config.offload and config.segments is None and config.deepspeed is None:
        return FULL_OFFLOAD
    return None


def offload_outlook(model: nn.Module, config: CkptConfig, names: list[str], forward: Callable[[], Any]) -> str | None:
    """The warning for ``config``'s offload on ``model`` where its copies cannot hide behind the step; None where
    they can, where it offloads nothing the timeline models, or where there is no host link (not CUDA)."""
    option = offloaded_option(config)
    if option is None or not names:
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    link = links.measure_link(device)
    if link is None:
        return None
    with cache_warnings_silenced():
        measured = profile(model, names, forward, timed=True, link=link)
    line = fixed_timeline(measured, option)
    base = KEEP if option == OFFLOAD else FULL
    keys = tuple(option if option in layer.options else base for layer in measured.layers)
    peak = predicted_peak(measured.layers, keys, measured.rest_running)[0]
    mode = "ckpt=offload" if option == OFFLOAD else "ckpt=full ckpt.offload=true"
    names_given = [config.layers] if isinstance(config.layers, str) else list(config.layers)
    layers = names_given[0] if len(names_given) == 1 else f"[{','.join(map(str, names_given))}]"  # as typed
    return cannot_hide(line, link, mode, layers, peak)


__all__ = ["offload_outlook", "offloaded_option"]
