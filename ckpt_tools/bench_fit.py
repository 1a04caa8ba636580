"""``ckpt-bench --fit LIMIT``: ``ckpt.memory`` with ``ckpt.batch=max`` on the bench's models, timed (issue #34).

``ckpt=auto ckpt.memory=LIMIT ckpt.batch=max`` (``ckpt_tools/fit_check.py``'s ``choose_fit``) with the model's
own optimizer: the batch and plan it chooses, the whole step predicted and measured, and samples per second
against no checkpointing at the same batch and at the largest batch that fits without it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from ckpt_plugin.apply.batch import Sample
from ckpt_plugin.apply.install import install_plan
from ckpt_tools.fit_check import Subject, choose_fit
from ckpt_tools.workloads import MODELS, Run, build

MiB = 2**20


@dataclass
class FitRun:
    """A model of a ``--fit`` row training as Lightning does: forward and loss, zero_grad, backward, optimizer step."""

    model: torch.nn.Module
    batch: tuple[torch.Tensor, ...]
    optimizer: torch.optim.Optimizer
    autocast: torch.dtype | None = None

    def step(self) -> None:
        with _autocast(self.batch[0].device, self.autocast):
            loss = self.model.loss(self.batch)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.batch[0].device.type == "cuda":
            torch.cuda.synchronize(self.batch[0].device)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _rows(batch: tuple[torch.Tensor, ...], size: int) -> tuple[torch.Tensor, ...]:
    """``batch`` made ``size`` rows long from its own rows, in turn: real data, each row its own memory."""
    return tuple(t[torch.arange(size, device=t.device) % t.shape[0]] for t in batch)


def fit_subject(name: str, args: argparse.Namespace) -> tuple[Subject, Run]:
    """The bench's model ``name`` (its size, batch and precision) as ``fit_check`` plans it, over ckpt=auto's layers."""
    spec = MODELS[name]
    run = build(spec, "none", args.quick, device=args.device, sizes=args.sizes.get(name), precision=args.precision)

    def sample(model: torch.nn.Module) -> Sample:
        device = run.batch[0].device

        def call(*a: Any, **k: Any) -> Any:
            with _autocast(device, run.autocast):
                return model(*a, **k)

        def step(batch: Any) -> torch.Tensor:
            with _autocast(device, run.autocast):
                return model.loss(batch)

        return Sample(((run.batch[0],), {}), call, run.batch, step)

    return Subject(name, lambda: copy.deepcopy(run.model), list(spec.auto_layers or [spec.layers]), sample), run


def measure_fit(name: str, args: argparse.Namespace, time_steps: Any) -> dict[str, Any]:
    """``--fit``: the batch and plan ``ckpt.memory=<limit> ckpt.batch=max`` chooses (the model's own optimizer), the
    whole step predicted and measured, and samples per second against no checkpointing at the same batch and at
    the largest batch that fits without it (both found on fake tensors)."""
    subject, run = fit_subject(name, args)
    chosen = choose_fit(subject, lambda model: model.configure_optimizers(), args.fit)
    pristine, plan = chosen.pop("pristine"), chosen.pop("wrap_plan")

    def fresh(size: int, planned: bool) -> FitRun:
        model = copy.deepcopy(pristine)
        if planned:
            install_plan(model, plan)
        return FitRun(model, _rows(run.batch, size), model.configure_optimizers(), run.autocast)

    runs = {"plan": fresh(chosen["batch"], True), "none": fresh(chosen["batch"], False)}
    if chosen["none_batch"] and chosen["none_batch"] != chosen["batch"]:
        runs["none_largest"] = fresh(chosen["none_batch"], False)
    with tqdm(total=args.repeats * len(runs), desc=f"ckpt-bench --fit {name}", unit="run", file=sys.stderr) as bar:
        seconds = time_steps(f"{name} fit", runs, args.repeats, args.steps, args.min_seconds, bar)
    per_second = {k: len(r.batch[0]) / statistics.median(seconds[k]) for k, r in runs.items()}
    per_second.setdefault("none_largest", per_second["none"] if chosen["none_batch"] else None)
    return chosen | {"fit": args.fit, "samples_per_s": per_second["plan"], "none_samples_per_s": per_second["none"],
                     "none_fits": chosen["none_at_batch"] <= chosen["limit"],
                     "none_largest_samples_per_s": per_second["none_largest"]}


def fit_table(fit: dict[str, dict[str, Any]]) -> list[str]:
    """``--fit``'s rows: what ckpt.memory with ckpt.batch=max chose, and its throughput against no checkpointing."""
    lines = ["## fit", "",
             "`ckpt=auto ckpt.memory=<limit> ckpt.batch=max`, the model's own optimizer: the batch and plan chosen "
             "(planned on fake tensors), the whole step (forward, zero_grad, backward, optimizer step; the second "
             "of two) predicted and measured (MemTracker, real tensors), and samples per second (median step) "
             "against no checkpointing at the same batch (whether its whole step fits the limit, on fake tensors) "
             "and at the largest batch whose whole step fits without checkpointing.", "",
             "| model | limit | batch | plan | predicted peak | measured peak | samples/s | none at that batch "
             "| samples/s | largest batch without | samples/s |",
             "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for model, r in fit.items():
        fits = "fits" if r["none_fits"] else "does not fit"
        largest = r["none_largest_samples_per_s"]
        lines.append(
            f"| {model} | {r['fit']}: {r['limit'] / MiB:.2f} MiB | {r['batch']} | {r['plan']} "
            f"| {r['predicted'] / MiB:.2f} MiB | {r['measured'] / MiB:.2f} MiB"
            f"{'' if r['measured'] <= r['limit'] else ' (over the limit: NO)'} | {r['samples_per_s']:.1f} "
            f"| {r['none_at_batch'] / MiB:.2f} MiB: {fits} | {r['none_samples_per_s']:.1f} "
            f"| {r['none_batch'] or 'none fits'} | {f'{largest:.1f}' if largest is not None else '–'} |")
    return [*lines, ""]


__all__ = ["FitRun", "fit_subject", "fit_table", "measure_fit"]
