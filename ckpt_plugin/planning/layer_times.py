"""What ``timing.py`` measured: each layer's seconds under each option, and the step times they predict.

    times.predicted_seconds({"blocks.0": FULL, "blocks.1": SELECTIVE})  # the step, in seconds

Only the step with every layer ``full`` is ever run whole; every other plan's
step is predicted from it: ``full_step_seconds - sum(added(full)) + sum(added(chosen))``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ckpt_plugin.planning.options import FULL, KEEP, Option

# (the option's name, or "option compiled (backend)", layer kind and input signature) -> seconds of one call; see
# measure_layer_times' ``cache``.
TimingCache = dict[tuple[str, tuple], float]


@dataclass(frozen=True)
class LayerTimes:
    """Measured seconds of each layer under each option, and of the step with every layer ``full``."""

    seconds: dict[str, dict[Option, float]]  # layer -> option -> forward + backward (+ recompute), summed over calls
    full_step_seconds: float  # one real training step with every candidate under "full"
    compiled: Mapping[Option, str] = field(default_factory=dict)  # option -> the backend it was timed through
    # layer -> compiled option -> bytes its compiled calls keep for backward (its inputs included), summed over calls
    kept_bytes: dict[str, dict[Option, int]] = field(default_factory=dict)
    parts: tuple[str, ...] = ()  # of ``seconds``, the parts inside layers (timed alone, not in the step with every layer full)
    # What the rest of the model keeps when the whole step runs compiled with every layer ``full`` (None: not
    # measured; see ``measure_layer_times``' ``whole_step``).
    compiled_rest_bytes: int | None = None
    # layer -> its forward alone under keep, summed over calls (read in the same timed calls): what offload's copies
    # out can hide behind (offload_plan.py); {} where not timed so.
    forward_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def how(self) -> str:
        """How the options were run when timed: ``eager``, or which ran compiled through which backend."""
        if not self.compiled:
            return "eager"
        by_backend: dict[str, list[str]] = {}
        for option, backend in self.compiled.items():
            by_backend.setdefault(backend, []).append(str(option))
        eager = [str(o) for o in next(iter(self.seconds.values()), {}) if o not in self.compiled]
        parts = [f"{_listed(options)} compiled ({backend})" for backend, options in by_backend.items()]
        return "; ".join(parts + ([f"{_listed(eager)} eager"] if eager else []))

    def added(self, name: str, option: Option) -> float:
        """What ``option`` adds to the step over not checkpointing layer ``name`` (0 for ``keep``)."""
        return self.seconds[name][option] - self.seconds[name][KEEP]

    @property
    def predicted_none_seconds(self) -> float:
        """The step without checkpointing, predicted (never run: it may not fit)."""
        return self.full_step_seconds - sum(self.added(name, FULL) for name in self.seconds if name not in self.parts)

    def predicted_seconds(self, choices: Mapping[str, Option]) -> float:
        """The step with layer ``name`` under ``choices[name]`` (``keep`` where not named)."""
        unknown = sorted(set(choices) - set(self.seconds))
        if unknown:
            raise ValueError(f"no timings for {', '.join(map(repr, unknown))}; timed: {', '.join(self.seconds)}")
        return self.predicted_none_seconds + sum(self.added(name, option) for name, option in choices.items())

    def __str__(self) -> str:
        options = list(next(iter(self.seconds.values()), {KEEP: 0.0}))
        width = max([len("layer"), *(len(name) for name in self.seconds)])
        lines = [f"{'layer':<{width}}  " + "  ".join(f"{f'{o} ms':>12}" for o in options)]
        lines += [f"{name:<{width}}  " + "  ".join(f"{1e3 * row[o]:>12.2f}" if o in row else f"{'-':>12}"
                                                 for o in options)
                  for name, row in self.seconds.items()]
        lines.append(f"step with every layer full: {1e3 * self.full_step_seconds:.1f} ms, "
                     f"predicted without checkpointing: {1e3 * self.predicted_none_seconds:.1f} ms; timed {self.how}")
        return "\n".join(lines)


def _listed(words: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])} and {words[-1]}"


__all__ = ["LayerTimes", "TimingCache"]
