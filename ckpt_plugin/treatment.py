"""How a wrapped call runs: checkpointed or not, with which selective policy, offloaded or not."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .config import CkptConfig
from .norms import keep_running_stats


@dataclass(frozen=True)
class Treatment:
    """How a wrapped call runs: checkpointed or not, with which policy, offloaded or not."""

    checkpointing: bool = True
    preserve_rng_state: bool = True
    policy: Any = None  # a policies.SelectivePolicy, shared by every module it wraps
    offload: bool = False
    deepspeed: Any = None  # deepspeed_ckpt.DeepSpeedCheckpointing: DeepSpeed's checkpoint instead of torch's

    @classmethod
    def of(cls, config: CkptConfig) -> Treatment:
        policy = None
        if config.mode == "selective":
            from .policies import make_policy

            policy = make_policy(config.policy, save_names=config.save_names, exclude_names=config.exclude_names)
        return cls(
            checkpointing=config.mode in ("full", "selective"),
            preserve_rng_state=getattr(config, "preserve_rng_state", True),
            policy=policy,
            offload=config.mode == "offload" or getattr(config, "offload", False),
            deepspeed=getattr(config, "deepspeed", None),
        )

    def offloading(self) -> contextlib.AbstractContextManager:
        if not self.offload:
            return contextlib.nullcontext()
        from .offload import offloading

        return offloading()

    def context_fn(self, stats: list) -> Callable[[], tuple] | None:
        """``checkpoint``'s context_fn: the policy's contexts plus the BatchNorm fix."""
        if self.policy is None and not stats:
            return None

        def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
            forward, recompute = self.policy.context_fn() if self.policy else (contextlib.nullcontext(),) * 2
            return forward, _both(recompute, keep_running_stats(stats))

        return contexts


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield
