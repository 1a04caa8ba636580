"""Two DDP ranks (gloo on CPU) whose layer timings disagree, for tests/test_plan_agreement.py.

    python tests/plan_agreement_worker.py OUT_DIR

Each rank times its layers' options through its own stand-in for
``timing.measure_layer_times`` (the real measurement, its seconds then replaced
by fixed ones): on rank 0 ``full`` costs little, on rank 1 the selective options
do. Before the fit, each rank plans alone on a copy of the model, as each would
without the callback's agreement, and records its choice; then one DDP fit of
one step with ``ckpt=auto`` (rank 0 plans, every rank installs its plan). Each
rank writes ``OUT_DIR/rank<r>.json`` (what it chose alone; what it installed:
names, each module's treatment, the plan's choices) and ``OUT_DIR/rank<r>.pt``
(its batch and the gradients of the step, after DDP's all-reduce).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckpt_examples.gpt import GPT
from ckpt_plugin import ActivationCheckpointing
from ckpt_plugin.apply.plan import plan_for
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.wrap import CheckpointedForward
from ckpt_plugin.planning import profile as profile_module
from ckpt_plugin.planning.options import FULL, KEEP

SIZE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0, batch_size=2)
KEYS = dict(mode="auto", layers="TransformerBlock", budget=0.5)
# What each option "costs" on each rank (seconds of one call, by the option's name): the ranks disagree on full
# against selective.
SECONDS = {0: {"keep": 1.0, "selective": 3.0, "selective_nb": 3.0, "full": 1.5},
           1: {"keep": 1.0, "selective": 1.1, "selective_nb": 1.1, "full": 5.0}}
_measure = profile_module.measure_layer_times


def disagreeing_timings(rank: int):
    def measure_layer_times(*args: Any, **kwargs: Any):
        times = _measure(*args, **kwargs)  # the real measurement runs, as it would
        table = SECONDS[rank]
        seconds = {name: {o: table.get(str(o), 2.0) for o in row} for name, row in times.seconds.items()}
        added_full = sum(row.get(FULL, 1.0) - row[KEEP] for name, row in seconds.items() if name not in times.parts)
        return replace(times, seconds=seconds, full_step_seconds=10.0 + added_full)

    return measure_layer_times


def model() -> GPT:
    torch.manual_seed(7)  # the same weights on every rank and in the test's single-process reference
    return GPT(**SIZE)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(96, (4, SIZE["block_size"]), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=2)


class Recorder(pl.Callback):
    """The batch and the all-reduced gradients of the first step."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.grads: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        if self.batch is None:
            self.batch = [t.clone() for t in batch]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()}


def main(out: Path) -> None:
    from rank_exit import leave  # beside this file

    rank = int(os.environ.get("LOCAL_RANK", 0))
    profile_module.measure_layer_times = disagreeing_timings(rank)  # ckpt=auto's profile calls it by this name
    alone, batch = model(), next(iter(data()))
    own = plan_for(alone, make_config(**KEYS), lambda: alone.loss(batch))
    net, recorder = model(), Recorder()
    callback = ActivationCheckpointing(**KEYS)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback, recorder], default_root_dir=out)
    installed: dict[str, str] = {}

    def record(trainer: pl.Trainer, module: pl.LightningModule) -> None:  # after on_fit_start, before teardown
        for name, m in module.named_modules():
            if isinstance(m.__dict__.get("forward"), CheckpointedForward):
                t = m.__dict__["forward"].treatment
                installed[name] = f"checkpointing={t.checkpointing} policy={t.policy!r}"

    net.on_train_start = lambda: record(trainer, net)
    trainer.fit(net, data())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world_size": trainer.world_size, "own_choices": _named(own.planned.choices), "wrapped": callback.wrapped,
        "installed": installed, "choices": _named(callback.planned.choices), "plan": callback.state_dict()["plan"],
        "plan_path": str(callback.plan_path) if callback.plan_path else None,
    }))
    torch.save({"batch": recorder.batch, "grads": recorder.grads}, out / f"rank{rank}.pt")
    leave(trainer.global_rank, getattr(trainer.strategy.launcher, "procs", []))


def _named(choices: dict) -> dict[str, str]:
    """A plan's choices as JSON holds them: each option by its name."""
    return {name: str(option) for name, option in choices.items()}


if __name__ == "__main__":
    # A script, not a test module: rank_exit lives beside it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(Path(sys.argv[1]))
