"""What ckpt-bench and ckpt-soak run: the example models, their batches, and the bench's modes.

A module of its own so that the two tools share it without importing each other.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_examples.gpt import GPT
from ckpt_examples.resnet import ResNet
from ckpt_plugin.apply.install import apply_config
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import AutoConfig, make_config
from ckpt_plugin.engine.wrap import install

T = TypeVar("T")

# Bench mode -> the keys of the ckpt node (``layers`` is added per model); None: ``hand``.
MODES: dict[str, dict[str, Any] | None] = {
    "none": {"mode": "none"},
    "hand": None,
    "full": {"mode": "full"},
    "every_n_2": {"mode": "full", "every_n": 2},
    "segments_sqrt": {"mode": "full", "segments": "sqrt"},
    "recursive": {"mode": "full", "segments": "recursive"},
    # Rotor's nesting of regions with the least recomputed FLOPs within half the activation peak.
    "segments_optimal": {"mode": "full", "segments": "optimal", "budget": 0.5},
    "selective": {"mode": "selective", "policy": "matmuls"},
    "auto_min": {"mode": "auto", "budget": "min"},  # the least peak ckpt=auto reaches, whatever it is
    "auto_0.1": {"mode": "auto", "budget": 0.1},
    "auto_0.25": {"mode": "auto", "budget": 0.25},
    "auto_0.5": {"mode": "auto", "budget": 0.5},
    "auto_0.75": {"mode": "auto", "budget": 0.75},
    "offload": {"mode": "offload"},
}


class HandGPT(GPT):
    """GPT whose ``forward`` checkpoints every block by hand, as a user would write it."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))  # (B, T, vocab)


class HandResNet(ResNet):
    """ResNet whose ``forward`` checkpoints every ``Bottleneck`` by hand.

    As everyone's hand-written version does, it updates BatchNorm running
    statistics twice per step (pytorch#96136); that changes no byte or FLOP.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            for block in stage:
                x = checkpoint(block, x, use_reentrant=False)  # (B, C, H', W')
        return self.fc(x.mean(dim=(2, 3)))


def _gpt_batch(model: GPT, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape, V = model.example_input_array.shape, model.hparams.vocab_size  # (B, T)
    return torch.randint(V, shape, generator=g), torch.randint(V, shape, generator=g)


def _resnet_batch(model: ResNet, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = model.example_input_array.shape  # (B, 3, H, W)
    return torch.randn(shape, generator=g), torch.randint(model.hparams.num_classes, shape[:1], generator=g)


@dataclass(frozen=True)
class ModelSpec:
    """One example model: its plain and hand-checkpointed classes, what to wrap, two sizes."""

    plain: type[nn.Module]
    hand: type[nn.Module]
    layers: str  # the class apply_checkpointing wraps and the hand-written forward checkpoints
    batch: Callable[[Any, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    quick: dict[str, Any]  # constructor overrides for --quick; the default size is the class's own
    auto_layers: tuple[str, ...] = ()  # ckpt=auto's candidates, when more than ``layers`` (a stem)


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec(
        GPT, HandGPT, "TransformerBlock", _gpt_batch,
        quick=dict(n_layer=4, n_embd=64, n_head=4, block_size=64, batch_size=4),
    ),
    "resnet": ModelSpec(
        ResNet, HandResNet, "Bottleneck", _resnet_batch,
        quick=dict(channels=16, image_size=16, batch_size=8),
        # The stem runs at full resolution and keeps a quarter of the activations: a candidate too.
        auto_layers=("Bottleneck", "re:stem"),
    ),
}


# Lightning's precision names -> the autocast dtype of the forward (None: no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {"32": None, "bf16-mixed": torch.bfloat16}


@dataclass
class Run:
    """One mode of one model: a fresh model, its batch and what was wrapped.

    For ``ckpt=auto``: ``planned`` is the planner's ``Plan`` (predicted peak and
    time) and ``planning_peak_bytes`` how much the process's peak resident
    memory grew while planning (None where Linux's /proc cannot tell).
    """

    model: nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    wrapped: int
    planned: Any = None
    planning_peak_bytes: int | None = None
    autocast: torch.dtype | None = None  # bf16-mixed: the forward under torch.autocast, as Lightning runs it

    @property
    def device(self) -> torch.device:
        return self.batch[0].device

    def loss(self) -> torch.Tensor:
        """The forward and loss, under autocast where the precision asks for it."""
        if self.autocast is None:
            return self.model.loss(self.batch)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return self.model.loss(self.batch)

    def step(self) -> None:
        self.loss().backward()
        self.model.zero_grad(set_to_none=True)
        if self.device.type == "cuda":  # kernels run asynchronously: a step is timed when it has run
            torch.cuda.synchronize(self.device)


def build(spec: ModelSpec, mode: str, quick: bool, seed: int = 0, *, device: str | torch.device = "cpu",
          sizes: dict[str, Any] | None = None, precision: str = "32") -> Run:
    """A fresh model for ``mode``: the default size, ``--quick``'s, then ``sizes`` over either; on ``device``.

    ``precision``: ``"32"`` or ``"bf16-mixed"`` (the forward under ``torch.autocast``, weights in fp32).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    torch.manual_seed(seed)  # the same weights in every mode
    keys = MODES[mode]
    device = torch.device(device)
    # Parameters made where they run: a GPU-sized model is not built on the CPU first.
    with device if device.type != "cpu" else contextlib.nullcontext():
        model = (spec.hand if keys is None else spec.plain)(**(spec.quick if quick else {}) | (sizes or {}))
    model.train()
    # Drawn on the CPU's generator, then moved: the same batch on every device.
    batch = tuple(t.to(device) for t in spec.batch(model, torch.Generator().manual_seed(seed + 1)))
    run = Run(model, batch, 0, autocast=PRECISIONS[precision])
    if keys is None:
        run.wrapped = sum(type(m).__name__ == spec.layers for m in model.modules())
        return run
    config = make_config(layers=list(spec.auto_layers or [spec.layers]) if keys["mode"] == "auto" else spec.layers,
                         **keys)
    if not isinstance(config, AutoConfig) and getattr(config, "segments", None) != "optimal":
        run.wrapped = len(apply_config(model, config))
        return run
    # Planned on the bench's own batch and loss (and precision), as a user's training step would be.
    name = next((n for n, known in MODELS.items() if known is spec), None)
    if name is not None:
        _warm_planning(name, device.type, precision)
    plan, run.planning_peak_bytes = peak_growth(lambda: plan_for(model, config, run.loss))
    run.wrapped, run.planned = len(install(model, plan)), plan.planned
    return run


@functools.cache
def _warm_planning(name: str, device: str, precision: str) -> None:
    """Plan ``ckpt=auto budget=min`` once on a quick model of ``MODELS[name]``, unmeasured, before the first
    planning the bench measures for it in this process.

    The first plan of a model's ops in a process pays one-off costs: torch's lazily loaded fake-tensor and
    MemTracker code, the kernels and fake implementations of its ops, the allocator's first arenas. Measured on
    the quick models, they were more than the model's activation peak (the quick ResNet's planning grew the
    process by 1.79 MB, its activation peak 1.42 MB, when the process had planned nothing before), and they are
    no part of what planning costs per model: what the table reports is what planning this model spends.
    """
    spec = MODELS[name]
    warm = build(spec, "none", quick=True, device=device, precision=precision)
    config = make_config(mode="auto", layers=list(spec.auto_layers or [spec.layers]), budget="min")
    plan_for(warm.model, config, warm.loss)


def peak_growth(fn: Callable[[], T]) -> tuple[T, int | None]:
    """``fn()`` and how many bytes the process's peak resident memory grew while it ran.

    Linux only: writing 5 to /proc/self/clear_refs restarts VmHWM (the peak) at the
    current RSS. Elsewhere the growth is None.
    """
    clear = Path("/proc/self/clear_refs")
    if not clear.exists():
        return fn(), None
    gc.collect()
    clear.write_text("5")
    before = _status_kib("VmRSS")
    result = fn()
    # Linux batches RSS accounting per thread: a few hundred KiB either way are its noise.
    return result, max(_status_kib("VmHWM") - before, 0) * 1024


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), flags=re.MULTILINE)
    assert match, field
    return int(match[1])


__all__ = ["MODELS", "MODES", "PRECISIONS", "ModelSpec", "Run", "build", "peak_growth"]
