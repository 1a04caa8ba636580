"""``ckpt_tools.overhead``: the plugin against hand-written checkpoint on the issue's tiny GPT.

Only what cannot depend on timing is asserted: what the report holds, and that
the two models compared do the same arithmetic (bitwise-equal gradients), so
that a ratio of their step times measures the plugin's overhead and nothing
else. The ratio itself is reported, never asserted (README, how we measure).
"""

from __future__ import annotations

import torch

from ckpt_plugin import wrapped_modules
from ckpt_tools.overhead import GPT_SIZE, measure_overhead, overhead_models


def test_the_two_models_compute_the_same_gradients_bitwise() -> None:
    plugin, hand, batch = overhead_models()
    assert wrapped_modules(plugin) == [f"blocks.{i}" for i in range(GPT_SIZE["n_layer"])]
    assert wrapped_modules(hand) == []  # it checkpoints in its own forward
    assert batch[0].shape == batch[1].shape == (GPT_SIZE["batch_size"], GPT_SIZE["block_size"])  # (B, T)
    grads = []
    for model in (plugin, hand):
        loss = model.loss(batch)
        loss.backward()
        grads.append([loss.detach(), *(p.grad for p in model.parameters())])
    assert len(grads[0]) == len(grads[1])
    for i, (a, b) in enumerate(zip(*grads, strict=True)):
        assert torch.equal(a, b), f"item {i} differs: max |diff| {(a - b).abs().max()}"


def test_report_has_positive_times_and_their_ratios() -> None:
    threads = torch.get_num_threads()
    report = measure_overhead(rounds=2, steps=1, threads=1)
    numbers = ["plugin_seconds", "hand_seconds", "plugin_over_hand", "plugin_over_hand_best",
               "plugin_cpu_seconds", "hand_cpu_seconds", "plugin_over_hand_cpu"]
    assert set(report) == {*numbers, "threads", "config"}
    for key in numbers:
        assert isinstance(report[key], float) and report[key] > 0, (key, report[key])
    assert report["plugin_over_hand"] == report["plugin_seconds"] / report["hand_seconds"]
    assert report["plugin_over_hand_cpu"] == report["plugin_cpu_seconds"] / report["hand_cpu_seconds"]
    assert report["threads"] == 1
    assert report["config"]["rounds"] == 2 and report["config"]["steps"] == 1
    assert torch.get_num_threads() == threads  # restored
