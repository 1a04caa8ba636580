"""One plan on every rank (``ckpt=auto``): the checkpoint's on a resume, else rank 0's, broadcast as plain data.

    plan, batch = agreed_plan(trainer, pl_module, config, forward)

Under several processes rank 0 plans and ``trainer.strategy.broadcast`` hands its
plan to every rank, which installs it, whatever its own timings say. Under DDP the
other ranks wait at the broadcast (the profile runs the module's own step, which
issues no collective); with SyncBatchNorm (its forward all-gathers statistics) every
rank measures in lockstep and installs rank 0's plan. An error on rank 0 reaches
every rank as data, so none waits at the broadcast forever.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from ckpt_plugin.apply.plan import candidates, plan_for
from ckpt_plugin.config.schema import AutoConfig
from ckpt_plugin.lightning.fsdp import plans_on_a_twin, twin_of
from ckpt_plugin.lightning.memory import memory_plan
from ckpt_plugin.lightning.strategies import error_as_data, error_from_data, rank_zero_plans_alone
from ckpt_plugin.lightning.zero import deepspeed_linear
from ckpt_plugin.planning.options import without_selective
from ckpt_plugin.planning.plan_file import plan_from_dict, plan_to_dict


def agreed_plan(trainer: pl.Trainer, pl_module: pl.LightningModule, config: AutoConfig,
                forward: Callable[[], Any] | None, resumed: dict[str, Any] | None = None,
                before_sharding: bool = False) -> tuple[Any, int | None]:
    """The plan every rank installs: ``resumed`` (the checkpoint's, on a resume with the same keys), else rank 0's;
    and the batch size ``ckpt.batch=max`` found (rank 0's), or None. ``before_sharding``: the module whole, in
    ``setup`` (FSDP, FSDP2, DeepSpeed): rank 0 plans alone (no forward of it issues a collective yet), under FSDP
    and FSDP2 the whole step on its twin."""
    if resumed is not None:
        plan = plan_from_dict(resumed, pl_module, "the checkpoint's plan (trainer.fit(ckpt_path=...))")
        lines = ["ckpt=auto: resuming with the checkpoint's plan, installed as it is, without planning "
                 f"({len(plan.names)} module(s))", str(plan.planned) if plan.planned is not None else ""]
        return replace(plan, summary="\n".join(filter(None, [plan.note, *lines]))), None
    world, rank = trainer.world_size, trainer.global_rank
    alone = world == 1 or before_sharding or rank_zero_plans_alone(trainer.strategy, pl_module)
    plan = error = batch = None
    if rank == 0 or not alone:
        who = "rank 0 measures" if world > 1 and alone else (
            "every rank measures (in lockstep; rank 0's plan is installed)" if world > 1 else "measuring")
        rank_zero_info(f"ckpt=auto: {who} the candidate layers (memory on fake tensors, step time one layer "
                       "at a time) to plan for " + ("ckpt.memory..." if config.read_memory is not None
                                                    else "ckpt.budget..."))
        try:
            # As FSDP or FSDP2 will shard the module; DeepSpeed plans the activations alone (strategies.py).
            twin = twin_of(trainer, pl_module) if before_sharding and plans_on_a_twin(trainer.strategy) else None
            with without_selective(deepspeed_linear(trainer.strategy)):  # ZeRO-3's linear: options.py says why
                if config.read_memory is not None:
                    plan, batch = memory_plan(trainer, pl_module, config, forward, twin)
                else:  # a layer FSDP wraps in a unit of its own runs there: no region over several
                    chains = twin is None or twin.regions_allowed(candidates(pl_module, config))
                    plan = plan_for(pl_module, config, forward, chains=chains)
        except Exception as err:
            if world == 1:
                raise
            error = err  # said to the other ranks, which would otherwise wait at the broadcast forever
    if world == 1:
        return plan, batch
    sent = None
    if rank == 0:
        sent = {"error": error_as_data(error)} if error is not None else {
            "plan": plan_to_dict(plan, pl_module), "summary": plan.summary, "batch": batch,
            "fit": plan.fit}  # ckpt.memory's prediction (frozen dataclasses of ints): each rank checks its step
    sent = trainer.strategy.broadcast(sent, src=0)
    if rank == 0 and error is not None:
        raise error
    if "error" in sent:
        raise error_from_data(sent["error"])
    agreed = plan_from_dict(sent["plan"], pl_module, "rank 0's plan")
    # Every rank measures its own step at the second batch against rank 0's prediction.
    return replace(agreed, summary=sent["summary"], fit=sent["fit"]), sent["batch"]


__all__ = ["agreed_plan"]
