"""torch's own memory-budget checkpointing under ``torch.compile``, beside the plugin's ``ckpt=auto``.

    python -m ckpt_tools.compiled --quick                  # the quick GPT: about a minute on 2 CPU cores
    python -m ckpt_tools.compiled --backend aot_eager      # the same partition, no C++ build

``torch._functorch.config.activation_memory_budget`` makes AOTAutograd's
min-cut partitioner recompute activations of a compiled graph, the fewest
FLOPs that bring its estimate of what the graph keeps beyond its inputs
(parameters, batch) to ``budget`` of that in the default partition (``1.0``:
the fastest one); ``0.0`` recomputes all it can. An estimate, not a cap: on
the quick GPT, 0.5 keeps 0.495 of the bytes compiled ``none`` keeps (0.522
with dropout off).
:func:`measure_compiled_budget` compiles the example GPT's loss twice, with
the budget and without (issue #12), so that ckpt-bench can put torch's budget
beside the plugin's eager ``ckpt=auto`` at the same budget.

What is measured:

- ``saved_bytes``: what the step's forward keeps for backward, counted by
  :func:`ckpt_plugin.measure.memory.saved_bytes` (unique storages packed by
  ``saved_tensors_hooks``, parameters and buffers excluded; for the plugin,
  also the inputs a checkpointed region holds). The compiled loss is one
  autograd function whose ``ctx.save_for_backward`` goes through those hooks,
  so for compiled code this is exactly the storages of its
  ``CompiledFunctionBackward`` node's ``saved_tensors`` (the test checks it).
  The same count for both eager rows, so every row compares. Not counted: the
  CPU RNG state (5 KiB) eager checkpoint keeps per region outside the hooks.
  ``MemTracker`` (ckpt-bench's ``act_peak_bytes``) cannot measure compiled
  code: it is a dispatch mode, and dynamo does not compile under one (it runs
  the frame eagerly; with ``fullgraph=True`` it raises).
- ``step_seconds``: median over ``rounds`` of the mean time of ``steps`` steps
  (loss, backward, ``zero_grad``), all rows in the same rounds, the order
  reversed every other round, gc disabled while timing, after two warm-up
  steps (the first compiles, forward and backward).

Backend: CPU inductor by default (g++ builds its kernels; about 30 s per
compile of the quick GPT on 2 cores). ``aot_eager`` runs the same dynamo
capture and the same partitioner, hence the same ``saved_bytes``, with eager
kernels: the tests use it for speed.

Each compiled row gets a backend object of its own that sets the budget while
it compiles: both GPTs run ``GPT.loss``, one code object, and dynamo would
otherwise run the second model on the first one's compiled graph (same guards),
silently ignoring the second budget (measured). Each must compile exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_plugin._compat import activation_memory_budget, compiler_backend
from ckpt_plugin.apply.install import apply_checkpointing
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.wrap import install
from ckpt_plugin.errors import ConfigError
from ckpt_plugin.measure.memory import saved_bytes
from ckpt_tools.workloads import MODELS, build

__all__ = ["PLUGIN_ROWS", "BudgetBackend", "CompiledRun", "compiled_run", "measure_compiled_budget"]

DEFAULT_BUDGET = 1.0  # torch's own default: the partition that is fastest, no recompute for memory


class BudgetBackend:
    """A ``torch.compile`` backend: torch's backend ``name`` with the partitioner's memory budget set.

    A fresh object per compiled model, so that dynamo compiles each model's
    frame for it (dynamo keeps compiled frames per backend); ``compiles``
    counts the graphs it compiled.
    """

    def __init__(self, name: str, budget: float) -> None:
        self.name = name
        self.budget = budget
        self.inner = compiler_backend(name)
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.compiles += 1
        with activation_memory_budget(self.budget):  # the partitioner reads it here, in the forward's compile
            return self.inner(gm, example_inputs)


@dataclass
class CompiledRun:
    """One GPT, its batch and its loss function (compiled, or the model's own for the eager rows)."""

    model: torch.nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    loss_fn: Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    budget: float | None = None  # None: eager
    backend: BudgetBackend | None = None
    times: list[float] = field(default_factory=list)  # seconds per step, one per round

    def step(self) -> None:
        self.loss_fn(self.batch).backward()
        self.model.zero_grad(set_to_none=True)

    def warm_up(self) -> None:
        # The first step compiles; patched around all of it, as inductor compiles the backward lazily.
        with contextlib.nullcontext() if self.budget is None else activation_memory_budget(self.budget):
            self.step()
        self.step()
        self.check_compiled_once()

    def check_compiled_once(self) -> None:
        """One graph per compiled model: none would mean it ran another model's graph (and budget),
        two that a guard failed and it recompiled, in a timed step perhaps."""
        if self.backend is not None and self.backend.compiles != 1:
            raise RuntimeError(f"the {self.backend.name} backend at budget {self.budget} compiled "
                               f"{self.backend.compiles} graphs, expected one for the whole loss")

    def saved_bytes(self) -> int:
        """Bytes one forward keeps for backward (see the module docstring)."""
        return saved_bytes(self.model, lambda: self.loss_fn(self.batch), owners=[]).total


def compiled_run(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], budget: float,
                 backend: str = "inductor") -> CompiledRun:
    """``model.loss`` compiled (one graph, ``fullgraph=True``) with the partitioner's budget at ``budget``.

    Compilation happens on the first call (:meth:`CompiledRun.warm_up`).
    """
    compiler = BudgetBackend(backend, budget)
    return CompiledRun(model, batch, torch.compile(model.loss, backend=compiler, fullgraph=True), budget, compiler)


def _time_rounds(runs: list[CompiledRun], rounds: int, steps: int) -> None:
    gc.collect()
    gc.disable()  # a collection inside one row's steps would be charged to that row
    try:
        for r in range(rounds):
            for run in runs if r % 2 == 0 else reversed(runs):
                start = time.perf_counter()
                for _ in range(steps):
                    run.step()
                run.times.append((time.perf_counter() - start) / steps)
    finally:
        gc.enable()


PLUGIN_ROWS: dict[str, dict[str, Any]] = {  # row -> the plugin's keys; compiled with torch's default budget
    "plugin_full": {"mode": "full"},
    "plugin_selective": {"mode": "selective"},
    **{f"plugin_auto_{b:g}": {"mode": "auto", "budget": b} for b in (0.5, 0.25, 0.1)},
}


def measure_compiled_budget(*, quick: bool, budget: float = 0.5, rounds: int = 5, steps: int = 2,
                            backend: str = "inductor", eager: bool = True,
                            plugin: Sequence[str] = ()) -> dict[str, Any]:
    """torch's memory budget under ``torch.compile`` against compiled ``none``, on the example GPT.

    Returns (bytes per step's forward, seconds per step; see the module docstring)::

        {"budget": 0.5, "backend": "inductor", "model": {GPT constructor overrides},
         "compiled_none":   {"saved_bytes": ..., "step_seconds": ...},  # compiled, budget 1.0
         "compiled_budget": {"saved_bytes": ..., "step_seconds": ...},  # compiled, budget ``budget``
         "act_fraction": compiled_budget / compiled_none saved bytes,
         "time_ratio":   compiled_budget / compiled_none step seconds,
         # with ``eager``: the plugin, no compile, the same model and batch
         "eager_none": {...}, "eager_auto": {..., "wrapped": [...]},  # ckpt=auto budget=``budget``
         "eager_act_fraction": ..., "eager_time_ratio": ...,
         # with ``plugin`` (names of PLUGIN_ROWS): the plugin's mode applied, then the loss compiled
         # whole as compiled none is (torch's default partition); ``auto`` plans with each option timed
         # compiled through ``backend`` (ckpt.timing), as the step runs
         "plugin": {"plugin_full": {"saved_bytes", "step_seconds", "act_fraction", "time_ratio"
                                    (to compiled none), "wrapped": [...], "plan": "..." (auto)}, ...}}

    The two budgets are relative to different baselines: torch's to what the
    compiled graph keeps by default, the plugin's to the eager activation peak;
    the absolute ``saved_bytes`` compare directly.
    """
    problems = []
    if not 0.0 <= budget <= 1.0:
        problems.append(f"budget={budget!r}: must be a fraction in [0, 1]")
    if rounds < 1 or steps < 1:
        problems.append(f"rounds={rounds!r}, steps={steps!r}: both must be at least 1")
    unknown = sorted(set(plugin) - set(PLUGIN_ROWS))
    if unknown:
        problems.append(f"plugin rows {', '.join(map(repr, unknown))}: valid rows are {', '.join(PLUGIN_ROWS)}")
    if problems:
        raise ValueError("; ".join(problems))
    spec = MODELS["gpt"]
    torch.compiler.reset()  # trace anew: nothing compiled before in this process is reused
    runs = {}
    for name, value in (("compiled_none", DEFAULT_BUDGET), ("compiled_budget", budget)):
        base = build(spec, "none", quick)  # the same seed, weights and batch as ckpt-bench's rows
        runs[name] = compiled_run(base.model, base.batch, value, backend)
    if eager:
        for name in ("eager_none", "eager_auto"):
            base = build(spec, "none", quick)
            runs[name] = CompiledRun(base.model, base.batch, base.model.loss)
        wrapped = apply_checkpointing(runs["eager_auto"].model, layers=spec.layers, mode="auto", budget=budget,
                                      timing="eager")
    plugin_wrapped: dict[str, Any] = {}
    for name in plugin:
        base = build(spec, "none", quick)
        keys = PLUGIN_ROWS[name] | ({"timing": backend} if PLUGIN_ROWS[name]["mode"] == "auto" else {})
        try:
            plugin_wrapped[name] = _apply_logged(base.model, layers=spec.layers, **keys)
        except ConfigError as err:  # a budget below what checkpointing the blocks reaches: the row says so
            plugin_wrapped[name] = {"error": str(err)}
            continue
        runs[name] = compiled_run(base.model, base.batch, DEFAULT_BUDGET, backend)
    for run in runs.values():
        run.warm_up()
    rows: dict[str, dict[str, Any]] = {name: {"saved_bytes": run.saved_bytes()} for name, run in runs.items()}
    _time_rounds(list(runs.values()), rounds, steps)
    for name, run in runs.items():
        run.check_compiled_once()  # nor did measuring or timing recompile
        rows[name]["step_seconds"] = statistics.median(run.times)
    result: dict[str, Any] = {"budget": budget, "backend": backend, "model": dict(spec.quick) if quick else {}}
    result |= {"compiled_none": rows["compiled_none"], "compiled_budget": rows["compiled_budget"]}
    result |= _ratios(rows["compiled_budget"], rows["compiled_none"])
    if eager:
        rows["eager_auto"]["wrapped"] = wrapped
        result |= {"eager_none": rows["eager_none"], "eager_auto": rows["eager_auto"]}
        result |= {f"eager_{k}": v for k, v in _ratios(rows["eager_auto"], rows["eager_none"]).items()}
    if plugin:
        result["plugin"] = {name: rows[name] | _ratios(rows[name], rows["compiled_none"]) | plugin_wrapped[name]
                            if name in rows else plugin_wrapped[name] for name in plugin}
    return result


def _apply_logged(model: torch.nn.Module, **keys: Any) -> dict[str, Any]:
    """Apply the plugin's ``keys``; the wrapped names and, for ``ckpt=auto``, the plan it logged."""
    plan = plan_for(model, make_config(**keys))
    wrapped = install(model, plan)
    return {"wrapped": wrapped} | ({"plan": plan.summary} if keys["mode"] == "auto" else {})


def _ratios(row: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    return {"act_fraction": row["saved_bytes"] / baseline["saved_bytes"],
            "time_ratio": row["step_seconds"] / baseline["step_seconds"]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small GPT (ckpt-bench --quick's)")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="inductor (needs g++) or aot_eager")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip the plugin's eager rows")
    parser.add_argument("--plugin", default="", help=f"comma-separated compiled plugin rows: {', '.join(PLUGIN_ROWS)} "
                        "or 'all'")
    args = parser.parse_args(argv)
    args.plugin = list(PLUGIN_ROWS) if args.plugin == "all" else [r for r in args.plugin.split(",") if r]
    print(json.dumps(measure_compiled_budget(**vars(args)), indent=2))


if __name__ == "__main__":
    main()
