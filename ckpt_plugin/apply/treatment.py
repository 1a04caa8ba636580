"""How every call of a layer a ``ckpt`` config selects runs: the engine's :class:`Treatment`, read from the config."""

from __future__ import annotations

from ckpt_plugin.config.schema import CkptConfig, OffloadConfig, SelectiveConfig
from ckpt_plugin.engine import deepspeed as deepspeed_checkpoint
from ckpt_plugin.engine.selective.policies import SelectivePolicy
from ckpt_plugin.engine.treatment import Treatment


def treatment_of(config: CkptConfig) -> Treatment:
    """How every call of a layer selected by ``config`` runs (not for ``none`` or ``auto``)."""
    if isinstance(config, OffloadConfig):
        return Treatment(checkpointing=False, offload=True)
    policy = None
    if isinstance(config, SelectiveConfig):
        policy = SelectivePolicy.of(config.read_policy)
    deepspeed = getattr(config, "deepspeed", None)
    return Treatment(
        checkpointing=True,
        preserve_rng_state=config.preserve_rng_state,
        policy=policy,
        offload=config.offload,
        checkpoint_fn=deepspeed_checkpoint.checkpointed_call if deepspeed is not None else None,
        check_recompute=config.check_recompute,
    )


def compiled_line(config: CkptConfig, backend: str | None, n: int) -> str:
    """What the plan's summary says of ``ckpt.compile`` ("" when off)."""
    if backend is None:
        return ""
    what = "" if isinstance(config, OffloadConfig) else ", its checkpoint included"
    return f"ckpt.compile: each of the {n} wrapped layer(s) runs compiled ({backend}){what}; compiled at its first call"


__all__ = ["compiled_line", "treatment_of"]
