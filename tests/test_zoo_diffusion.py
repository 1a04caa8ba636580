"""``layers=auto`` on diffusers models (``ckpt_tools/zoo/diffusion.py``): what diffusers checkpoints itself.

For each of UNet2DConditionModel, DiT, PixArt, SD3, Flux and AutoencoderKL
(tiny configs, called as a training step calls them), auto chooses exactly the
classes that diffusers' ``enable_gradient_checkpointing()`` runs through its
checkpointing function, and wraps those modules (found here by running it with
a function that records them; one more in the UNet, see ``ALSO``). PixArt had
(issue #33) the ``Attention`` modules wrapped, two per block, at 2.59x
diffusers' peak. All six train in ``tests/test_zoo.py`` (every zoo entry): loss,
gradients and buffers bitwise those without checkpointing, and an activation
peak (MemTracker) at most 1.05x diffusers' own checkpointing (ours/own 0.974 to
1.000).
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from ckpt_plugin.engine.selection import resolve_layers, select_layers
from ckpt_tools.zoo.diffusion import models

pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a second thread only waits (conftest)

ZOO = {entry.name: entry for entry in models()}


def _called_by_diffusers(entry: Any) -> list[str]:
    """Names of the modules diffusers' own checkpointing runs through its function in one forward,
    outermost (a call inside another's is the VAE mid block's resnets, inside the mid block's)."""
    model = entry.build()
    names = {id(m): n for n, m in model.named_modules()}
    called: list[str] = []
    depth = [0]

    def record(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if depth[0] == 0:
            called.append(names[id(module)])
        depth[0] += 1
        try:
            return module(*args, **kwargs)
        finally:
            depth[0] -= 1

    model.enable_gradient_checkpointing(record)
    model(**entry.batch())
    return called


def test_the_zoo_has_the_six() -> None:
    assert list(ZOO) == ["diffusers.unet2d_condition", "diffusers.dit", "diffusers.pixart", "diffusers.sd3",
                         "diffusers.flux", "diffusers.autoencoder_kl"]


# Instances of a chosen class that diffusers runs outside its checkpoints: UNetMidBlock2DCrossAttn.forward
# calls self.resnets[0] directly, before its loop checkpoints the others (diffusers 0.42, unet_2d_blocks.py).
# Choosing classes, auto checkpoints that one too.
ALSO = {"diffusers.unet2d_condition": ["mid_block.resnets.0"]}


@pytest.mark.parametrize("name", ZOO)
def test_auto_picks_what_diffusers_checkpoints(name: str) -> None:
    entry = ZOO[name]
    model = entry.build()
    order = [n for n, _ in model.named_modules()]
    expected = sorted(_called_by_diffusers(entry) + ALSO.get(name, []), key=order.index)
    assert resolve_layers(model, "auto") == (entry.units, (
        f"ckpt.layers=auto chose {', '.join(entry.units)} (diffusers gradient_checkpointing): {len(expected)} modules"))
    assert select_layers(model, "auto") == expected


# Bitwise and at most 1.05x diffusers' own peak, for all six: tests/test_zoo.py's test_auto_on_the_zoo.
