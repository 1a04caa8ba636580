"""What the plugin costs per step over hand-written ``torch.utils.checkpoint`` (issue #12, point 5: at most 2 %).

    python -c "from ckpt_tools.overhead import measure_overhead; print(measure_overhead())"

The same tiny GPT (width 64, 12 blocks, 32 tokens, batch 2, no dropout: small
enough that Python overhead, not arithmetic, decides the step time) is built
twice from one seed: once wrapped by ``apply_checkpointing(layers="TransformerBlock")``
(mode full), once as ``workloads.HandGPT``, whose forward calls
``checkpoint(block, x, use_reentrant=False)`` itself. Both run interleaved
rounds of ``steps`` training steps (forward, loss, backward, ``zero_grad``; no
optimiser, it is the same in both), the order alternating each round, with the
garbage collector off while timing. ``plugin_over_hand`` is the ratio of the
median per-step wall times; ``plugin_over_hand_best``, of the fastest rounds,
and ``plugin_over_hand_cpu``, of the median CPU times of this process (which
exclude the time other processes hold the cores), are less sensitive to a
shared machine. Timings are reported, never asserted (``tests/test_overhead.py``
checks only what cannot depend on them).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch
from torch import nn

from ckpt_examples.gpt import GPT
from ckpt_plugin.apply.install import apply_checkpointing
from ckpt_tools.workloads import HandGPT, _gpt_batch

# The model: 12 blocks of width 64 on 32 tokens, batch 2; dropout off so that
# both models draw no random numbers and their gradients must agree bit for bit.
GPT_SIZE = dict(n_layer=12, n_embd=64, n_head=4, block_size=32, batch_size=2, dropout=0.0)
LAYERS = "TransformerBlock"
WARMUP_STEPS = 5  # allocator and autograd caches settle in the first steps


def overhead_models(seed: int = 0) -> tuple[nn.Module, nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The plugin's model (mode full on every block), the hand-written one, and their batch ((B, T) twice)."""
    torch.manual_seed(seed)
    plugin = GPT(**GPT_SIZE)
    torch.manual_seed(seed)  # the same weights
    hand = HandGPT(**GPT_SIZE)
    assert len(apply_checkpointing(plugin, layers=LAYERS)) == GPT_SIZE["n_layer"]
    batch = _gpt_batch(plugin, torch.Generator().manual_seed(seed + 1))  # (B, T) tokens and targets
    return plugin.train(), hand.train(), batch


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One training step without the optimiser: forward, loss, backward, gradients cleared."""
    model.loss(batch).backward()
    model.zero_grad(set_to_none=True)


def _seconds_per_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step over ``steps`` steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step(model, batch)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def measure_overhead(*, rounds: int = 15, steps: int = 20, threads: int = 1) -> dict[str, Any]:
    """Per-step seconds of the plugin's full mode and of hand-written checkpoint, and their ratios.

    Runs ``rounds`` rounds of ``steps`` steps per model on ``threads`` intra-op
    threads (restored afterwards); about ``2 * rounds * steps`` steps in all.
    """
    if rounds < 1 or steps < 1 or threads < 1:
        raise ValueError(f"rounds={rounds}, steps={steps} and threads={threads} must all be >= 1")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    gc_was_enabled = gc.isenabled()
    try:
        plugin, hand, batch = overhead_models()
        models = {"plugin": plugin, "hand": hand}
        for model in models.values():
            _seconds_per_step(model, batch, WARMUP_STEPS)
        wall: dict[str, list[float]] = {name: [] for name in models}
        cpu: dict[str, list[float]] = {name: [] for name in models}
        gc.collect()
        gc.disable()  # a collection would land in whichever model happens to run
        for r in range(rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for name in order:
                w, c = _seconds_per_step(models[name], batch, steps)
                wall[name].append(w)
                cpu[name].append(c)
    finally:
        if gc_was_enabled:
            gc.enable()
        torch.set_num_threads(previous_threads)
    plugin_s, hand_s = statistics.median(wall["plugin"]), statistics.median(wall["hand"])
    plugin_cpu, hand_cpu = statistics.median(cpu["plugin"]), statistics.median(cpu["hand"])
    return {
        "plugin_seconds": plugin_s,
        "hand_seconds": hand_s,
        "plugin_over_hand": plugin_s / hand_s,
        "plugin_over_hand_best": min(wall["plugin"]) / min(wall["hand"]),
        "plugin_cpu_seconds": plugin_cpu,
        "hand_cpu_seconds": hand_cpu,
        "plugin_over_hand_cpu": plugin_cpu / hand_cpu,
        "threads": threads,
        "config": {
            "model": f"GPT({', '.join(f'{k}={v}' for k, v in GPT_SIZE.items())})",
            "plugin": f"apply_checkpointing(model, layers={LAYERS!r})",
            "hand": "workloads.HandGPT: checkpoint(block, x, use_reentrant=False)",
            "rounds": rounds,
            "steps": steps,
            "torch": torch.__version__,
        },
    }


__all__ = ["GPT_SIZE", "measure_overhead", "overhead_models", "step"]
