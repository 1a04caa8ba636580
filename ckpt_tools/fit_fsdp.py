"""``python -m ckpt_tools.fit_fsdp``: ``ckpt.memory`` under FSDP, its prediction on a fake twin against real ranks.

    python -m ckpt_tools.fit_fsdp --quick                     # GPT and ResNet, 2 layers each, AdamW, 2 ranks
    python -m ckpt_tools.fit_fsdp --batch --out fsdp.json     # + five zoo models, AdamW and SGD, the batch search
    python -m ckpt_tools.fit_fsdp --strategy fsdp,fsdp2       # both FSDPs, one launch
    python -m ckpt_tools.fit_fsdp --strategy deepspeed_stage_2  # DeepSpeed ZeRO-2, its rank's step modelled
    python -m ckpt_tools.fit_fsdp --strategy deepspeed_stage_3  # ZeRO-3, its gathering played on the fake step
    python -m ckpt_tools.fit_fsdp --strategy deepspeed_stage_3_offload  # ZeRO-3, optimizer and parameters offloaded
    python -m ckpt_tools.fit_fsdp --strategy deepspeed_stage_3_bf16  # ZeRO-3 in bf16 (also _1_bf16, _2_bf16)

``fit_check``'s checks (the same models, optimizers, limits and tables), each on
``--world`` gloo processes on the CPU, the model sharded with one unit per layer
``ckpt.layers`` selects, by each ``--strategy``: ``fsdp`` (v1, FULL_SHARD,
``use_orig_params=True``; Lightning's ``FSDPStrategy``) or ``fsdp2`` (``fully_shard`` on
each layer, then on the whole model, over a 1-D mesh of the ranks: what a
``configure_model`` does under Lightning's ``ModelParallelStrategy``), or ``deepspeed_stage_1``,
``deepspeed_stage_2`` and ``deepspeed_stage_3`` (a DeepSpeed engine, fp32; rank 0's prediction is the module's own
step modelled as a ZeRO rank's, ``ckpt_plugin/apply/zero.py``, under ZeRO-3 with DeepSpeed's gathering played on
it, checked within 5 % instead of ``TOLERANCE``: ``zero_ranks.py``):

1. rank 0 measures the whole step on the fake twin that FSDP shards as rank 0
   (``ckpt_plugin/apply/twin.py``: fake tensors, a fake process group; FSDP2: a mesh of them), without
   checkpointing (W0) and with ``ckpt=auto``'s least plan (Wmin); the limits are
   ``Wmin + f * (W0 - Wmin)``;
2. for each limit rank 0 plans (``plan_for`` on the whole module, every whole
   step on the twin), every rank installs that plan on a fresh copy sharded by
   real FSDP over gloo, under the names FSDP gave the layers (FSDP2 keeps them), and measures its real
   whole step (MemTracker, the second of two steps); the row's measured peak is
   the largest of the ranks', which the prediction (rank 0's) is checked against:
   the ranks' shards differ (FSDP2 cuts each parameter along its first dimension,
   so one of fewer rows than ranks, a ViT's class token, sits on rank 0 alone);
3. ``--batch``: at the middle limit, ``ckpt.batch=max``'s search on the twin
   against real sharded steps at every batch size from 1 (each size's least plan,
   every rank), up to the first that does not fit on some rank.

The exit status is 1 where a row fails its check (a rank over the limit, a
prediction off by more than ``fit_check.TOLERANCE``, a batch other than the
exhaustive search's).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ckpt_examples.sharding import shard_blocks
from ckpt_plugin._compat import fake_device_mesh
from ckpt_plugin.apply.batch import MOST, Sample, largest_batch
from ckpt_plugin.apply.install import install_plan
from ckpt_plugin.apply.plan import candidates, plan_for
from ckpt_plugin.apply.twin import TwinSteps, make_twin, names_after_wrapping, renamed, twin_sample
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.engine.plan import WrapPlan
from ckpt_plugin.engine.side_effects import cache_warnings_silenced
from ckpt_plugin.measure.whole_step import StepSplit, whole_step
from ckpt_plugin.planning.options import without_selective
from ckpt_plugin.planning.plan_file import plan_from_dict, plan_to_dict
from ckpt_tools.fit_check import (
    OPTIMIZERS,
    TOLERANCE,
    Subject,
    add_arguments,
    chosen,
    least_plan,
    options_of,
    parse_list,
    subject,
    tables,
)
from ckpt_tools.workloads import peak_growth
from ckpt_tools.zero_ranks import STAGES, predicted_steps, real_step

__all__ = ["STRATEGIES", "Sharding", "main", "rooted", "sharded", "through"]

STRATEGIES = {"fsdp": "FSDP (v1, FULL_SHARD)", "fsdp2": "FSDP2 (fully_shard on each layer and the root)",
              "deepspeed_stage_1": "DeepSpeed ZeRO-1 (fp32, modelled: ckpt_tools/zero_ranks.py)",
              "deepspeed_stage_2": "DeepSpeed ZeRO-2 (fp32, modelled: ckpt_tools/zero_ranks.py)",
              "deepspeed_stage_3": "DeepSpeed ZeRO-3 (fp32, its gathering played on the fake step: "
                                   "ckpt_tools/zero_ranks.py)",
              "deepspeed_stage_3_offload": "DeepSpeed ZeRO-3, optimizer and parameters offloaded to host memory "
                                           "(the device here: counted)",
              **{f"deepspeed_stage_{n}_bf16": f"DeepSpeed ZeRO-{n} in bf16 (the module cast, a float32 master copy)"
                 for n in (1, 2, 3)}}
# ZeRO's step is modelled, an upper bound of every rank's (ckpt_plugin/apply/zero.py): issue #43's mark for it.
ZERO_TOLERANCE = 0.05


def through(root: nn.Module, inner: nn.Module, call: Callable[[], Any]) -> Any:
    """``call()`` run inside ``root``'s forward, where ``inner`` (the module ``root`` wraps) would run: FSDP's root
    gathers its parameters around it (what Lightning's ``_ForwardRedirection`` does for ``training_step``)."""
    own = vars(inner).get("forward")  # an instance-level forward the module had, put back as it was

    def put_back() -> None:
        if own is not None:
            inner.forward = own
        else:
            vars(inner).pop("forward", None)

    def redirected(*args: Any, **kwargs: Any) -> Any:
        put_back()  # the call runs the module's own forward
        return call()

    inner.forward = redirected
    try:
        return root()
    finally:
        put_back()


def rooted(sample: Sample, root: nn.Module, inner: nn.Module) -> Sample:
    """``sample`` (bound to ``inner``) with its call and step run through ``root``."""
    step = sample.step
    return replace(sample, run=lambda *a, **k: through(root, inner, lambda: sample.run(*a, **k)),
                   step=None if step is None else (lambda batch: through(root, inner, lambda: step(batch))))


def _policy(model: nn.Module, names: Sequence[str]) -> Any:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({type(model.get_submodule(n)) for n in names})  # one unit per selected layer


@dataclass(frozen=True)
class Sharding:
    """How a copy of the model is sharded: ``strategy`` (a key of :data:`STRATEGIES`), a unit per layer ``names``;
    ``mesh`` the run's ``DeviceMesh`` (FSDP2)."""

    strategy: str
    names: tuple[str, ...]
    mesh: Any = None

    def wrap(self, model: nn.Module, group: Any = None) -> nn.Module:
        """The root ``model`` is run through: FSDP (v1) around it over ``group`` (None: the default one), or ``model``
        itself, ``fully_shard``-ed on the mesh (a fake one of its layout where ``group`` is given: the twin's)."""
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(model, process_group=group, auto_wrap_policy=_policy(model, self.names),
                                            device_id=torch.device("cpu"), use_orig_params=True)
        mesh = self.mesh if group is None else fake_device_mesh(self.mesh)
        shard_blocks(model, [model.get_submodule(name) for name in self.names], mesh)  # as the examples' configure_model
        return model

    def sample(self, subject: Subject, model: nn.Module, root: nn.Module) -> Sample:
        """``subject``'s sample on ``model``, run as the strategy runs it: through FSDP's root (FSDP2 hooks the
        model itself)."""
        sample = subject.sample(model)
        return sample if root is model else rooted(sample, root, model)


def sharded(subject: Subject, pristine: nn.Module, plan: WrapPlan, optimizer: str, sharding: Sharding,
            batch: int | None = None) -> StepSplit:
    """This rank's real whole step: a copy of ``pristine`` sharded over the default group, ``plan`` installed under
    the names the sharding gave its layers, a fresh optimizer, at ``batch`` rows (None: the sample's); under
    DeepSpeed, in its engine."""
    if sharding.strategy in STAGES:
        return real_step(sharding.strategy, subject.sample, pristine, plan, OPTIMIZERS[optimizer], batch)
    model = copy.deepcopy(pristine)
    before = dict(model.named_modules())
    root = sharding.wrap(model)
    sample = sharding.sample(subject, model, root)
    with cache_warnings_silenced():
        install_plan(model, renamed(plan, names_after_wrapping(before, model)))
        opt = OPTIMIZERS[optimizer](root.parameters())
        return whole_step(model, sample.loss(batch), [opt], fake=False).holding((sample.held(batch),))


def _shared(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _largest(value: int) -> int:
    """The largest of the ranks' ``value``."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return max(every)


def check_sharded(subject: Subject, optimizer: str, fractions: Sequence[float], batch: bool, strategy: str,
                  mesh: Any = None) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """``fit_check.check_model`` under ``strategy``: on every rank, each rank's real step against rank 0's
    prediction."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pristine = subject.build()
    model = copy.deepcopy(pristine)
    names = candidates(model, make_config(mode="auto", layers=subject.layers, budget="min"))
    sharding = Sharding(strategy, tuple(names), mesh)
    sample = subject.sample(model)
    steps: Any = None
    one = None
    chains = True
    if rank == 0 and strategy in STAGES:  # the module's own step, modelled as a ZeRO rank's
        steps = predicted_steps(strategy, model, sample, OPTIMIZERS[optimizer])
    elif rank == 0:  # the twin: rank 0's shards, as the strategy will cut them
        twin = make_twin(model, sharding.wrap, lambda m: [OPTIMIZERS[optimizer](m.parameters())], rank=0,
                         world_size=world)
        chains = twin.regions_allowed(names)  # False: a unit per layer, no region over several (Measuring.chains)
        inner = sharding.sample(subject, twin.module, twin.wrapped)
        steps = TwinSteps(twin, twin_sample(twin, inner, inner.run, inner.step))
    if rank == 0:
        without, least = steps.of(WrapPlan()), steps.of(least_plan(model, names, sample.forward(), chains))
        one = {"model": subject.name, "optimizer": optimizer, "strategy": strategy, "sample_batch": sample.size,
               "w0": without.peak, "wmin": least.peak, "w0_split": str(without), "wmin_split": str(least),
               "world_size": world}
    one = _shared(one)
    limits = [one["wmin"] + round(f * (one["w0"] - one["wmin"])) for f in fractions]
    rows = []
    for fraction, limit in zip(fractions, limits, strict=True):
        planned = data = None
        seconds = 0.0
        if rank == 0:
            start = time.perf_counter()
            planned = plan_for(model, make_config(mode="auto", layers=subject.layers, memory=f"{limit}B"),
                               sample.forward(), steps=steps, chains=chains)
            seconds = time.perf_counter() - start
            data = {"plan": plan_to_dict(planned, model), "predicted": planned.fit.split.peak,
                    "options": options_of(planned, names)}
        data = _shared(data)
        plan = plan_from_dict(data["plan"], pristine, "rank 0's plan")
        measured = sharded(subject, pristine, plan, optimizer, sharding).peak
        every: list[Any] = [None] * world
        dist.all_gather_object(every, measured)
        predicted = data["predicted"]
        rows.append({"model": subject.name, "optimizer": optimizer, "strategy": strategy, "fraction": fraction,
                     "limit": limit,
                     "plan": data["options"], "predicted": predicted, "measured": max(every), "ranks": every,
                     "fits": max(every) <= limit, "ratio": predicted / max(every),
                     "within": abs(predicted / max(every) - 1) <= (ZERO_TOLERANCE if strategy in STAGES else TOLERANCE),
                     "planning_s": seconds})
    found = check_batch(subject, pristine, optimizer, names, sharding, limits[len(limits) // 2], steps, sample,
                        _shared(chains)) if batch else None
    return one, rows, found


def check_batch(subject: Subject, pristine: nn.Module, optimizer: str, names: list[str], sharding: Sharding, limit: int,
                steps: Any, sample: Sample, chains: bool) -> dict[str, Any]:
    """``ckpt.batch=max``'s search on rank 0's twin, then real sharded steps at every size on every rank."""
    model = copy.deepcopy(pristine)
    chosen = None
    seconds, grown, tried = 0.0, 0, {}
    if dist.get_rank() == 0:
        start = time.perf_counter()
        fit, grown = peak_growth(lambda: largest_batch(model, names, sample, limit, [], bound=MOST, steps=steps,
                                                       chains=chains))
        seconds, chosen, tried = time.perf_counter() - start, fit.batch, fit.tried
    chosen = _shared(chosen)
    bound, largest, real = 2 * chosen + 2, 0, {}
    start = time.perf_counter()
    for b in range(1, bound + 1):
        plan = _shared(plan_to_dict(least_plan(model, names, sample.forward(b), chains), model)
                       if dist.get_rank() == 0 else None)
        real[b] = _largest(sharded(subject, pristine, plan_from_dict(plan, pristine), optimizer, sharding, b).peak)
        if real[b] > limit:
            break
        largest = b
    return {"model": subject.name, "optimizer": optimizer, "strategy": sharding.strategy, "limit": limit,
            "sample_batch": sample.size,
            "chosen": chosen, "exhaustive": largest, "equal": chosen == largest, "search_s": seconds,
            "rss_growth": grown, "tried": tried, "real": real, "exhaustive_s": time.perf_counter() - start,
            "bounded": largest == bound}


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    steps, rows, batches = [], [], []
    try:
        mesh = None
        if "fsdp2" in args["strategies"]:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HF's config notes, FSDP's fake-tensor data_ptr note: known here
            for strategy in args["strategies"]:
                for name in args["models"]:
                    s = subject(name, args["quick"])
                    for optimizer in args["optimizers"]:
                        t0 = time.perf_counter()
                        # ZeRO-3's engine installs DeepSpeed's linear: no selective options (planning/options.py)
                        # (for the process: a later strategy in the same launch runs under it too)
                        deepspeed_linear = torch.nn.functional.linear.__module__.startswith("deepspeed")
                        with without_selective(STAGES.get(strategy) == 3 or deepspeed_linear):
                            one, limits, found = check_sharded(s, optimizer, args["fractions"], args["batch"],
                                                               strategy, mesh)
                        steps.append(one)
                        rows += limits
                        batches += [found] if found else []
                        if rank == 0:
                            print(f"fit_fsdp: {strategy} {name} {optimizer}: {time.perf_counter() - t0:.1f} s",
                                  file=sys.stderr, flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps({"steps": steps, "limits": rows, "batch": batches}, default=str))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m ckpt_tools.fit_fsdp",
                                                   description=__doc__.split("\n")[0]))
    parser.add_argument("--world", type=int, default=2, help="gloo processes (ranks); default 2")
    parser.add_argument("--strategy", default="fsdp",
                        help=f"comma-separated subset of {', '.join(STRATEGIES)}, each run in the same launch "
                             "(default: fsdp)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.world < 2:
        parser.error(f"--world={args.world}: at least 2 ranks (one rank shards nothing; fit_check covers it)")
    subjects, optimizers, fractions = chosen(args, parser)  # an unknown name: the parser's error, before any rank
    strategies = parse_list(args.strategy, list(STRATEGIES), "--strategy", parser)
    models = [s.name for s in subjects]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fsdp.json"
        settings = {"models": models, "optimizers": optimizers, "fractions": fractions, "batch": args.batch,
                    "quick": args.quick, "strategies": strategies}
        # The ranks are forked from a server that imported this module (torch, Lightning, the examples) once,
        # not started bare: each would import them again (seconds per rank on 2 CPU cores).
        mp.get_context("forkserver").set_forkserver_preload([__name__])  # read when the server starts
        mp.start_processes(_rank, args=(args.world, _free_port(), settings, str(out)), nprocs=args.world,
                           start_method="forkserver")
        result = json.loads(out.read_text())
    total = time.perf_counter() - started
    for strategy in strategies:
        def of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [r for r in rows if r["strategy"] == strategy]

        print(f"{STRATEGIES[strategy]}, {args.world} gloo ranks; measured: the largest rank's real step\n")
        print(tables(of(result["steps"]), of(result["limits"]), of(result["batch"])) + "\n")
    print(f"\n{len(result['limits'])} limits, {len(result['batch'])} batch searches, {total:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "seconds": total, "world_size": args.world}, indent=2,
                                       default=str) + "\n")
    failed = [r for r in result["limits"] if not (r["fits"] and r["within"])] + \
        [b for b in result["batch"] if not b["equal"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
