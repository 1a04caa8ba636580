"""``python -m ckpt_tools.fit_check``: does ``ckpt.memory`` fit the device, and ``ckpt.batch=max`` find the batch?

    python -m ckpt_tools.fit_check --quick                    # GPT and ResNet, 2 layers each, AdamW
    python -m ckpt_tools.fit_check --batch --out fit.json     # + five zoo models, AdamW and SGD, the batch search
    python -m ckpt_tools.fit_check --models gpt,hf.llama --optimizers sgd --fractions 0.25,0.75

For each model and optimizer, in one process (issue #34):

1. the whole step (``measure/whole_step.py``: the second of two training steps,
   Lightning's order) on fake tensors without checkpointing (W0) and with
   ``ckpt=auto``'s least plan (Wmin), at the sample's batch; the limits are
   ``Wmin + f * (W0 - Wmin)`` for each ``--fractions`` f;
2. for each limit, ``ckpt=auto ckpt.memory=<limit>B`` planned on a fresh copy of
   the model, installed on another copy made before any step, and the *real*
   whole step measured there (MemTracker, ``whole_step(fake=False)``, a fresh
   optimizer of the same kind): is it within the limit, and the predicted peak
   within ``TOLERANCE`` of it;
3. ``--batch``: at the middle limit, ``ckpt.batch=max``'s search
   (``apply/batch.py``: fake tensors), against an exhaustive one with real steps:
   for b = 1, 2, ... the least plan at b installed on a fresh copy and its real
   whole step measured, up to the first b that does not fit (at most twice the
   chosen batch and 2). Lightning's BatchSizeFinder cannot be the reference here:
   on the CPU there is no out-of-memory for it to catch.

Prints a markdown table per part and, with ``--out``, writes them as JSON. The
exit status is 1 where any row fails its check.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_examples.gpt import GPT
from ckpt_examples.resnet import ResNet
from ckpt_plugin.apply.batch import MOST, Sample, largest_batch, largest_fitting
from ckpt_plugin.apply.install import install_plan
from ckpt_plugin.apply.memory import whole_of
from ckpt_plugin.apply.plan import candidates, plan_for
from ckpt_plugin.apply.strategies import Measuring, least_of, strategies
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.errors import closest_first
from ckpt_plugin.measure.whole_step import StepSplit, whole_step
from ckpt_plugin.units import format_bytes, parse_size
from ckpt_tools.workloads import peak_growth

__all__ = ["FRACTIONS", "OPTIMIZERS", "SUBJECTS", "TOLERANCE", "Subject", "add_arguments", "choose_fit", "chosen",
           "least_plan", "limit_of",
           "main", "optimizer_of", "options_of", "real_step"]

FRACTIONS = (0.1, 0.5, 0.9)  # of the way from the least whole step to the one without checkpointing
TOLERANCE = 0.02  # predicted / measured whole-step peak, at most this far from 1
SEED = 0

# --optimizers: the name -> a fresh optimizer over the parameters given (its state is part of the whole step).
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),  # two moments per parameter
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),  # one momentum buffer per parameter
    # DeepSpeed's CPU Adam, which it asks for under offload (deepspeed_stage_3_offload): its op is built on first use
    "cpu_adam": lambda params: _cpu_adam(params),
}
DEFAULT_OPTIMIZERS = ("adamw", "sgd")


def _cpu_adam(params: Any) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=1e-3)


@dataclass(frozen=True)
class Subject:
    """One model the check runs: a fresh seeded copy, the layers ``ckpt=auto`` plans over, and its training
    sample bound to a given copy (the call ``ckpt.batch=max`` resizes and the step to its loss)."""

    name: str
    build: Callable[[], nn.Module]
    layers: str | list[str]
    sample: Callable[[nn.Module], Sample]


def _example(name: str, cls: type[nn.Module], layers: str | list[str], target: Callable[[nn.Module], torch.Tensor],
             **sizes: Any) -> Subject:
    """An example model of ``ckpt_examples``: its ``example_input_array`` filled with data, its own ``loss``."""
    def build() -> nn.Module:
        torch.manual_seed(SEED)
        return cls(**sizes).train()

    def sample(model: nn.Module) -> Sample:
        g = torch.Generator().manual_seed(SEED + 1)  # the same batch for every copy
        x = model.example_input_array
        x = torch.randint(model.hparams.vocab_size, x.shape, generator=g) if x.dtype == torch.long else \
            torch.randn(x.shape, generator=g)
        batch = (x, target(model, x, g))
        return Sample(((x,), {}), lambda *a, **k: model(*a, **k), batch, model.loss)

    return Subject(name, build, layers, sample)


def _zoo(entry: Any) -> Subject:
    """A zoo model (``ckpt_tools/zoo``): its keyword batch, its loss, ``ckpt.layers=auto``."""
    def build() -> nn.Module:
        model = entry.build().train()
        for module in model.modules():  # as a checkpointed training call runs (zoo/measure.py's _cache_off)
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", None):
                config.use_cache = False
        return model

    def sample(model: nn.Module) -> Sample:
        batch = entry.batch()
        return Sample(((), batch), lambda *a, **k: model(*a, **k), batch, lambda b: entry.loss(model(**b)))

    return Subject(entry.name, build, "auto", sample)


def _gpt(**sizes: Any) -> Subject:
    return _example("gpt", GPT, "TransformerBlock",
                    lambda m, x, g: torch.randint(m.hparams.vocab_size, x.shape, generator=g), **sizes)


def _resnet(**sizes: Any) -> Subject:
    return _example("resnet", ResNet, "Bottleneck",
                    lambda m, x, g: torch.randint(m.hparams.num_classes, x.shape[:1], generator=g), **sizes)


# The examples at the check's sizes, and --quick's: half the layers and width (planning's cost is per op).
SUBJECTS: dict[str, Callable[[], Subject]] = {
    "gpt": lambda: _gpt(n_layer=4, n_embd=64, block_size=64, batch_size=4),
    "resnet": lambda: _resnet(channels=16, batch_size=4),
}
QUICK_SUBJECTS: dict[str, Callable[[], Subject]] = {
    "gpt": lambda: _gpt(n_layer=2, n_embd=32, n_head=2, block_size=16, batch_size=2),
    "resnet": lambda: _resnet(channels=8, depths=(1, 1), image_size=16, batch_size=4),
}
# Five zoo families that plan in seconds: a decoder, an encoder, a vision transformer, torch's own, a conv stack.
ZOO = ("hf.llama", "hf.bert", "hf.vit", "torch.transformer_encoder", "shape.regnet")
QUICK = ("gpt", "resnet")


def subject(name: str, quick: bool = False) -> Subject:
    if name in SUBJECTS:
        return (QUICK_SUBJECTS if quick else SUBJECTS)[name]()
    from ckpt_tools.zoo import (
        all_models,  # transformers and the rest: imported only when a zoo model is asked for
    )

    entry = next((e for e in all_models() if e.name == name), None)
    if entry is None:
        raise ValueError(f"--models: {name!r} is neither an example ({', '.join(SUBJECTS)}) nor a zoo model "
                         f"(python -m ckpt_tools.zoo lists them)")
    return _zoo(entry)


def least_plan(model: nn.Module, names: list[str], forward: Callable[[], Any], chains: bool = True) -> WrapPlan:
    """``ckpt=auto``'s least plan at ``forward``'s batch (every strategy, memory only), as ckpt.batch=max plans it;
    ``chains``: ``Measuring.chains`` (False: per-layer plans only, as under FSDP with a unit per layer)."""
    chosen = least_of(strategies(Measuring(model, names, forward, {}, True, timed=False, chains=chains), eager=True))
    return chosen.strategy.installed(chosen.plan)


Make = Callable[[nn.Module], torch.optim.Optimizer]  # a fresh optimizer over a model's parameters


def optimizer_of(name: str) -> Make:
    return lambda model: OPTIMIZERS[name](model.parameters())


def real_step(subject: Subject, pristine: nn.Module, plan: WrapPlan, make: Make, batch: int | None = None
              ) -> StepSplit:
    """The real whole step (MemTracker) of a copy of ``pristine`` (never stepped) with ``plan`` installed and a
    fresh optimizer (``make``), at ``batch`` rows (None: the sample's), and the batch beside it (made before the
    measured step, as a loader's is: MemTracker does not see it, the device holds it; ``Sample.held``)."""
    model = copy.deepcopy(pristine)
    sample = subject.sample(model)
    with cache_warnings_silenced():
        install_plan(model, plan)
        return whole_step(model, sample.loss(batch), [make(model)], fake=False).holding((sample.held(batch),))


def options_of(plan: WrapPlan, planned_over: Sequence[str] | None = None) -> str:
    """``2 full, 1 selective, 1 keep`` for a per-layer plan (the options of ``planned_over``, its layers;
    those of their parts after them); ``3 nested regions`` for Rotor's schedule."""
    planned = plan.planned
    choices = getattr(planned, "choices", None)
    if choices is not None:  # the layers' options, then those of the parts listed after their layer
        layers = [n for n in choices if n in planned_over] if planned_over is not None else \
            [n for n in choices if not any(n.startswith(f"{o}.") for o in choices)]
        parts = [n for n in choices if n not in layers]
        said = _counted(str(choices[n].kind) for n in layers) or "nothing wrapped"
        return said + (f" (parts: {_counted(str(choices[n].kind) for n in parts)})" if parts else "")
    if planned is not None and hasattr(planned, "schedule"):
        from ckpt_plugin.planning.rotor import regions

        return f"{len(regions(planned.schedule))} nested regions"
    return f"{len(plan.names)} wrapped" if plan.names else "nothing wrapped"


def _counted(kinds: Any) -> str:
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


def check_model(subject: Subject, optimizer: str, fractions: Sequence[float], batch: bool
                ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """Parts 1 to 3 for one model and optimizer: the two whole steps, a row per limit, the batch search's row."""
    pristine = subject.build()  # copied for every model below: none of them has stepped
    model = copy.deepcopy(pristine)
    opt = OPTIMIZERS[optimizer](model.parameters())
    sample = subject.sample(model)
    config = make_config(mode="auto", layers=subject.layers, budget="min")  # budget: only to name the layers
    names = candidates(model, config)
    without = whole_step(model, sample.loss(), [opt]).holding((sample.held(),))
    least = whole_of(model, least_plan(model, names, sample.forward()), sample.loss(), [opt], (sample.held(),))
    steps = {"model": subject.name, "optimizer": optimizer, "sample_batch": sample.size, "w0": without.peak,
             "wmin": least.peak, "w0_split": str(without), "wmin_split": str(least)}
    rows = []
    limits = [least.peak + round(f * (without.peak - least.peak)) for f in fractions]
    for fraction, limit in zip(fractions, limits, strict=True):
        planned = copy.deepcopy(pristine)
        opt = OPTIMIZERS[optimizer](planned.parameters())
        sample = subject.sample(planned)
        start = time.perf_counter()
        plan = plan_for(planned, make_config(mode="auto", layers=subject.layers, memory=f"{limit}B"),
                        sample.forward(), optimizers=[opt], step=sample.loss(), held=(sample.held(),))
        seconds = time.perf_counter() - start
        measured = real_step(subject, pristine, plan, optimizer_of(optimizer))
        predicted = plan.fit.split.peak
        rows.append({"model": subject.name, "optimizer": optimizer, "fraction": fraction, "limit": limit,
                     "plan": options_of(plan, names), "predicted": predicted, "measured": measured.peak,
                     "fits": measured.peak <= limit, "ratio": predicted / measured.peak,
                     "within": abs(predicted / measured.peak - 1) <= TOLERANCE, "planning_s": seconds})
    found = None
    if batch:
        found = check_batch(subject, pristine, optimizer, names, limits[len(limits) // 2])
    return steps, rows, found


def check_batch(subject: Subject, pristine: nn.Module, optimizer: str, names: list[str], limit: int
                ) -> dict[str, Any]:
    """``ckpt.batch=max``'s search on fake tensors, then the exhaustive one with real steps, at ``limit``."""
    model = copy.deepcopy(pristine)
    opt = OPTIMIZERS[optimizer](model.parameters())
    sample = subject.sample(model)
    start = time.perf_counter()
    fit, grown = peak_growth(lambda: largest_batch(model, names, sample, limit, [opt], bound=MOST))
    seconds = time.perf_counter() - start
    # Exhaustive: every size from 1, each with its own least plan and a real step, to the first that does not fit.
    bound, largest, real = 2 * fit.batch + 2, 0, {}
    start = time.perf_counter()
    for b in range(1, bound + 1):
        plan = least_plan(model, names, sample.forward(b))
        real[b] = real_step(subject, pristine, plan, optimizer_of(optimizer), b).peak
        if real[b] > limit:
            break
        largest = b
    exhaustive_s = time.perf_counter() - start
    return {"model": subject.name, "optimizer": optimizer, "limit": limit, "sample_batch": sample.size,
            "chosen": fit.batch, "exhaustive": largest, "equal": fit.batch == largest, "search_s": seconds,
            "rss_growth": grown, "tried": fit.tried, "real": real, "exhaustive_s": exhaustive_s,
            "bounded": largest == bound}


def limit_of(spec: str, least: int, without: int) -> int:
    """``--fit``'s limit in bytes: a fraction f in [0, 1] of the way from the least whole step to the one without
    checkpointing (``0.5``), or a size (``3MiB``, ``3145728B``)."""
    size = parse_size(spec)
    if size is not None:
        return size
    try:
        fraction = float(spec)
    except ValueError:
        fraction = -1.0
    if not 0 <= fraction <= 1:
        raise ValueError(f"--fit={spec!r} is neither a fraction in [0, 1] of the way from the least whole step to "
                         "the one without checkpointing (0.5) nor a size (3MiB)")
    return least + round(fraction * (without - least))


def choose_fit(subject: Subject, make: Make, spec: str) -> dict[str, Any]:
    """What ``ckpt.memory=<limit> ckpt.batch=max`` chooses for ``subject`` and what it measures: the batch and plan,
    the plan's whole step predicted and real, and the batches without checkpointing (fake tensors): whether the
    chosen one fits and the largest that does (0: none); and, for the caller to time them, ``pristine`` (the model
    before any step, to copy) and ``wrap_plan`` (the plan)."""
    pristine = subject.build()
    model = copy.deepcopy(pristine)
    opt = make(model)
    sample = subject.sample(model)
    names = candidates(model, make_config(mode="auto", layers=subject.layers, budget="min"))
    without = whole_step(model, sample.loss(), [opt]).holding((sample.held(),))
    least = whole_of(model, least_plan(model, names, sample.forward()), sample.loss(), [opt], (sample.held(),))
    limit = limit_of(spec, least.peak, without.peak)
    start = time.perf_counter()
    found = largest_batch(model, names, sample, limit, [opt], bound=MOST)
    # As the callback plans ckpt.batch=max (lightning/memory.py): at the batch found, timed on the sample's own.
    plan = plan_for(model, make_config(mode="auto", layers=subject.layers, memory=f"{limit}B"),
                    sample.forward(found.batch), optimizers=[opt], timing_forward=sample.forward(),
                    step=sample.loss(found.batch), held=(sample.held(found.batch),))
    seconds = time.perf_counter() - start
    measured = real_step(subject, pristine, plan, make, found.batch)

    def none_peak(b: int) -> int:
        return whole_of(model, WrapPlan(), sample.loss(b), [opt], (sample.held(b),)).peak

    return {"limit": limit, "w0": without.peak, "wmin": least.peak, "sample_batch": sample.size,
            "batch": found.batch, "plan": options_of(plan, names), "predicted": plan.fit.split.peak,
            "measured": measured.peak, "planning_s": seconds, "none_at_batch": none_peak(found.batch),
            # On CUDA: the allocator's peak over the measured step (its rounding, the batch) and what it reserved.
            "cuda_allocated": measured.cuda_allocated, "cuda_reserved": measured.cuda_reserved,
            "none_batch": largest_fitting(none_peak, sample.size, MOST, limit), "pristine": pristine,
            "wrap_plan": plan}


def _mib(n: int | None) -> str:
    return "–" if n is None else format_bytes(n)


def tables(steps: list[dict], rows: list[dict], batches: list[dict]) -> str:
    lines = ["## Whole step at the sample batch (fake tensors)", "",
             "| model | optimizer | batch | W0 (no checkpointing) | Wmin (least plan) |", "|---|---|---:|---:|---:|"]
    lines += [f"| {s['model']} | {s['optimizer']} | {s['sample_batch']} | {_mib(s['w0'])} ({s['w0']} B) "
              f"| {_mib(s['wmin'])} ({s['wmin']} B) |" for s in steps]
    lines += ["", "## ckpt.memory: the plan's real whole step against its limit", "",
              "| model | optimizer | f | limit (B) | plan | predicted (B) | measured (B) | measured <= limit "
              "| predicted / measured | planning (s) |", "|---|---|---:|---:|---|---:|---:|---|---:|---:|"]
    lines += [f"| {r['model']} | {r['optimizer']} | {r['fraction']:g} | {r['limit']} | {r['plan']} | {r['predicted']} "
              f"| {r['measured']} | {'yes' if r['fits'] else 'NO'} | {r['ratio']:.4f}{'' if r['within'] else ' NO'} "
              f"| {r['planning_s']:.1f} |" for r in rows]
    if batches:
        lines += ["", "## ckpt.batch=max at the middle limit: the search (fake) against real steps at every size",
                  "", "| model | optimizer | limit (B) | chosen | exhaustive | equal | sizes planned | search (s) "
                  "| RSS growth | exhaustive (s) |", "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {b['model']} | {b['optimizer']} | {b['limit']} | {b['chosen']} | {b['exhaustive']}"
                  f"{' (bound)' if b['bounded'] else ''} | {'yes' if b['equal'] else 'NO'} | {len(b['tried'])} "
                  f"| {b['search_s']:.1f} | {_mib(b['rss_growth'])} | {b['exhaustive_s']:.1f} |" for b in batches]
        lines += ["", "Lightning's BatchSizeFinder cannot run as a reference here: it doubles the batch until a real "
                  "step runs out of memory, and on the CPU there is no out-of-memory to catch. RSS growth: how much "
                  "the process's peak resident memory grew during the search (VmHWM, workloads.peak_growth)."]
    return "\n".join(lines)


def parse_list(value: str, valid: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    """A comma-separated flag's items, each one of ``valid`` (else the parser's error, closest first), in order."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    for item in items:
        if item not in valid:
            parser.error(f"{flag}: {item!r} is not one of them; valid, closest first: "
                         f"{', '.join(closest_first(item, valid))}")
    if not items:
        parser.error(f"{flag} is empty; valid: {', '.join(valid)}")
    return list(dict.fromkeys(items))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags fit_check and fit_fsdp share: which models, optimizers, limits, the batch search, --quick, --out."""
    parser.add_argument("--models", default=None,
                        help=f"comma-separated: {', '.join(SUBJECTS)} or zoo names (default: those and "
                        f"{', '.join(ZOO)}; --quick: {', '.join(QUICK)})")
    parser.add_argument("--optimizers", default=None,
                        help=f"comma-separated subset of {', '.join(OPTIMIZERS)} (default: "
                        f"{', '.join(DEFAULT_OPTIMIZERS)}; --quick: adamw; cpu_adam builds DeepSpeed's op, ~70 s)")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                        help="the limits, as fractions of the way from Wmin to W0 (each in [0, 1])")
    parser.add_argument("--batch", action="store_true", help="also ckpt.batch=max against the exhaustive search")
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK)} at smaller sizes (2 layers), adamw only (--models and "
                        "--optimizers still choose)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="python -m ckpt_tools.fit_check",
                                                 description=__doc__.split("\n")[0]))


def chosen(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[Subject], list[str], list[float]]:
    """The subjects, optimizers and fractions the flags of :func:`add_arguments` name; the parser's error else."""
    models = [m.strip() for m in (args.models or ",".join(QUICK if args.quick else (*SUBJECTS, *ZOO))).split(",")
              if m.strip()]
    optimizers = parse_list(args.optimizers or ("adamw" if args.quick else ",".join(DEFAULT_OPTIMIZERS)),
                            list(OPTIMIZERS),
                            "--optimizers", parser)
    try:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except ValueError:
        fractions = []
    if not fractions or any(not 0 <= f <= 1 for f in fractions):
        parser.error(f"--fractions={args.fractions!r}: comma-separated numbers in [0, 1], e.g. 0.1,0.5,0.9")
    try:
        subjects = [subject(m, args.quick) for m in models]
    except ValueError as err:
        parser.error(str(err))
    return subjects, optimizers, fractions


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    subjects, optimizers, fractions = chosen(args, parser)
    started = time.perf_counter()
    steps, rows, batches = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's config notes and "use_cache=False" advice: known here
        for s in subjects:
            for optimizer in optimizers:
                t0 = time.perf_counter()
                one, limits, found = check_model(s, optimizer, fractions, args.batch)
                steps.append(one)
                rows += limits
                batches += [found] if found else []
                print(f"fit_check: {s.name} {optimizer}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    total = time.perf_counter() - started
    print(tables(steps, rows, batches))
    print(f"\n{len(rows)} limits, {len(batches)} batch searches, {total:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"steps": steps, "limits": rows, "batch": batches, "seconds": total},
                                       indent=2, default=str) + "\n")
    failed = [r for r in rows if not (r["fits"] and r["within"])] + [b for b in batches if not b["equal"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
