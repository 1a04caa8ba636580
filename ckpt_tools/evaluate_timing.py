"""How well ``planning/timing.py`` predicts the step time of real plans.

    python -m ckpt_tools.evaluate_timing --clock process        # GPT, small GPT, ResNet: ~10 minutes on 2 cores
    python -m ckpt_tools.evaluate_timing --models gpt_small,resnet --rounds 10 --clock process   # ~1 minute

For each example model (fresh, seed 0, the batch of ``workloads.py``):
``measure_layer_times`` once, then real steps of a few plans installed with
``apply_checkpointing`` (``none``, ``full``, ``selective``, ``full`` on every
second layer), interleaved: each round applies each plan in turn, runs one
warm-up step and one timed step, with the garbage collector off. A step is
forward, loss and backward (no optimiser: the same in every plan). Prints, per
plan, the median measured step, the predicted step and the error.

One intra-op thread by default, and ``--clock process`` (CPU seconds of this
process, for the prediction and the real steps alike) on a machine shared with
other work: there a second thread, and wall-clock time, measure the neighbours.
The numbers are in ``docs/bench/timing.md``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckpt_examples.gpt import GPT
from ckpt_examples.resnet import ResNet
from ckpt_plugin.apply.install import apply_checkpointing
from ckpt_plugin.planning.options import FULL, KEEP, OPTIONS, SELECTIVE, Option
from ckpt_plugin.planning.profile import treatment
from ckpt_plugin.planning.timing import measure_layer_times
from ckpt_tools.workloads import _gpt_batch, _resnet_batch

# name -> (model factory, batch maker, candidate class)
WORKLOADS: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], str]] = {
    "gpt": (GPT, _gpt_batch, "TransformerBlock"),
    "gpt_small": (lambda: GPT(n_layer=4, n_embd=64, n_head=4, block_size=64, batch_size=4), _gpt_batch,
                  "TransformerBlock"),
    "resnet": (ResNet, _resnet_batch, "Bottleneck"),
}

# plan -> (apply_checkpointing keys, the option of candidate i of n)
PLANS: dict[str, tuple[dict[str, Any], Callable[[int], Option]]] = {
    "none": ({"mode": "none"}, lambda i: KEEP),
    "full": ({"mode": "full"}, lambda i: FULL),
    "selective": ({"mode": "selective", "policy": "matmuls"}, lambda i: SELECTIVE),
    "alternate": ({"mode": "full", "every_n": 2}, lambda i: FULL if (i + 1) % 2 == 0 else KEEP),
}


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def step_seconds(model: nn.Module, batch: Any, clock: Callable[[], float]) -> float:
    model.zero_grad(set_to_none=True)
    start = clock()
    model.loss(batch).backward()
    return clock() - start


def evaluate(workload: str, rounds: int, repeats: int, clock: Callable[[], float]) -> dict[str, Any]:
    make, make_batch, layer_class = WORKLOADS[workload]
    torch.manual_seed(0)
    model = make()
    model.train()
    batch = make_batch(model, torch.Generator().manual_seed(1))
    names = [n for n, m in model.named_modules() if type(m).__name__ == layer_class]
    start = time.perf_counter()
    times = measure_layer_times(model, names, lambda: model.loss(batch), {o: treatment(o) for o in OPTIONS},
                                repeats=repeats, clock=clock)
    cost = time.perf_counter() - start
    measured: dict[str, list[float]] = {plan: [] for plan in PLANS}
    gc.disable()
    try:
        for _ in range(rounds):
            for plan, (keys, _option) in PLANS.items():
                apply_checkpointing(model, layers=layer_class, **keys)
                step_seconds(model, batch, clock)  # warm-up after re-wrapping
                measured[plan].append(step_seconds(model, batch, clock))
    finally:
        gc.enable()
        apply_checkpointing(model, layers=layer_class, mode="none")
    rows = {}
    for plan, (_keys, option) in PLANS.items():
        predicted = times.predicted_seconds({name: option(i) for i, name in enumerate(names)})
        real = statistics.median(measured[plan])
        rows[plan] = {"measured": real, "predicted": predicted, "error": predicted / real - 1,
                      "spread": (min(measured[plan]), max(measured[plan]))}
    return {"times": times, "rows": rows, "measure_seconds": cost}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--repeats", type=int, default=3, help="measure_layer_times' repeats")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; 1 is steadiest on a shared machine, where a second "
                             "thread waits on other processes")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="process: CPU seconds of this process, blind to other processes (with --threads 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for workload in args.models.split(","):
        result = evaluate(workload, args.rounds, args.repeats, CLOCKS[args.clock])
        print(f"\n== {workload}: measure_layer_times took {result['measure_seconds']:.1f} s")
        print(result["times"])
        print(f"{'plan':<10} {'measured ms':>12} {'(min..max)':>18} {'predicted ms':>13} {'error':>7}")
        for plan, row in result["rows"].items():
            lo, hi = row["spread"]
            print(f"{plan:<10} {1e3 * row['measured']:>12.1f} {f'{1e3 * lo:.0f}..{1e3 * hi:.0f}':>18} "
                  f"{1e3 * row['predicted']:>13.1f} {100 * row['error']:>+6.1f}%")


if __name__ == "__main__":
    main()
