"""The typed schema of the ``ckpt`` config node, one dataclass per mode.

Every mode is a small kw-only dataclass holding only its own fields. The same
classes serve twice: Hydra's ConfigStore builds the YAML presets in
``ckpt_plugin/config/ckpt/`` on their keys (so ``ckpt.foo=1`` is Hydra's error,
and a preset has exactly these keys), and :func:`make_config` builds them from
keyword arguments, for the Python API and for every Hydra app alike, validating
in ``__post_init__`` with errors that name the key, the value and what would
work. Values are judged here only, never converted by OmegaConf on the way
(``config/hydra.py``): ``ckpt.preserve_rng_state=2`` is an error, not true.

The schema imports no framework (no torch, Lightning, Hydra or OmegaConf at
import time), so Hydra's search-path plugin can register it in any app
cheaply; validating a value that needs the engine (a policy's op names, a
segment count) imports it then. Dispatch on a mode is by type
(``isinstance(config, AutoConfig)``), never by comparing ``mode`` strings:
``mode`` is only what a YAML preset or ``make_config(mode=...)`` selects the
class by. The callback's ``_target_`` is added by the Hydra layer
(``config/hydra.py``), not here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

from ckpt_plugin.config.budget import parse_budget
from ckpt_plugin.config.deepspeed import settings_of
from ckpt_plugin.errors import ConfigError, Problem, closest_first, raise_problems

MISSING = "???"  # OmegaConf's MISSING value, without importing OmegaConf (the schema loads no framework)


def _quote_all(items: Iterable[str]) -> str:
    return ", ".join(repr(i) for i in items)


@dataclass(kw_only=True)
class LayerSelection:
    """Which modules to checkpoint; shared by every mode that wraps modules."""

    # "auto" (the model's blocks: what its library checkpoints itself, HF's GradientCheckpointingLayer,
    # else the repeated blocks of its structure: engine/blocks.py), or class names ("TransformerBlock"), module names ("head",
    # "blocks.3"), dotted class paths ("pkg.mod.Block"), module-name globs ("blocks.*") or
    # regexes ("re:blocks\.[0-9]+"); a string or a list. A plain word that names a module wins.
    # Required; None (YAML null) until the user names them, so our message, not Hydra's, says so.
    layers: Any = None
    # Wrap every n-th matched layer (the n-th, 2n-th, ...): 1 wraps all of them.
    every_n: int = 1

    def _problems(self) -> list[Problem]:
        problems: list[Problem] = []
        layers = self.layers
        if layers is None or layers == MISSING:
            problems.append(Problem(
                "ckpt.layers",
                "ckpt.layers is required: name the modules to checkpoint, e.g. "
                "ckpt.layers=TransformerBlock or ckpt.layers=[Block,'blocks.*'], or let "
                "ckpt.layers=auto choose them (or choose ckpt=none to switch checkpointing off)",
            ))
        else:
            if isinstance(layers, str):
                layers = [layers]
            if not isinstance(layers, Iterable) or isinstance(layers, (bytes, dict)):
                problems.append(Problem(
                    "ckpt.layers",
                    f"ckpt.layers={layers!r} ({type(layers).__name__}) must be a string or a list "
                    "of strings: class names, dotted class paths, module-name globs or 're:' regexes",
                ))
            else:
                layers = list(layers)
                bad = [x for x in layers if not isinstance(x, str) or not x.strip()]
                if bad:
                    problems.append(Problem(
                        "ckpt.layers",
                        f"ckpt.layers: every entry must be a non-empty string, got {_quote_all(bad)}"
                        if all(isinstance(b, str) for b in bad)
                        else f"ckpt.layers: every entry must be a string, got {bad!r}",
                    ))
                elif not layers:
                    problems.append(Problem(
                        "ckpt.layers",
                        "ckpt.layers=[] names no layers: give at least one class name or pattern, "
                        "or choose ckpt=none to switch checkpointing off",
                    ))
                else:
                    self.layers = tuple(x.strip() for x in layers)
                    if "auto" in self.layers and len(self.layers) > 1:
                        others = ", ".join(repr(x) for x in self.layers if x != "auto")
                        problems.append(Problem(
                            "ckpt.layers",
                            "ckpt.layers: 'auto' chooses every layer itself and cannot be combined with "
                            f"other entries ({others})",
                            "give ckpt.layers=auto alone, or name every layer",
                        ))
        if isinstance(self.every_n, bool) or not isinstance(self.every_n, int):
            problems.append(Problem(
                "ckpt.every_n",
                f"ckpt.every_n={self.every_n!r} ({type(self.every_n).__name__}) must be an integer >= 1",
            ))
        elif self.every_n < 1:
            problems.append(Problem(
                "ckpt.every_n",
                f"ckpt.every_n={self.every_n} must be >= 1: 1 wraps every matched layer, "
                "2 every second one, ...",
            ))
        return problems


def _check_bool(key: str, value: Any) -> list[Problem]:
    if isinstance(value, bool):
        return []
    return [Problem(f"ckpt.{key}", f"ckpt.{key}={value!r} ({type(value).__name__}) must be true or false")]


def _checkpointing_problems(config: FullConfig | SelectiveConfig) -> list[Problem]:
    """What full and selective check alike: the layers, preserve_rng_state, check_recompute, segments, offload."""
    from ckpt_plugin.config.values import segment_problems

    problems = config._problems() + _check_bool("preserve_rng_state", config.preserve_rng_state)
    problems += _check_bool("check_recompute", config.check_recompute)
    if config.check_recompute is True and config.segments is not None:
        problems.append(Problem(
            "ckpt.check_recompute",
            f"ckpt.check_recompute=true cannot be combined with ckpt.segments={config.segments}: it names the "
            "one module a checkpoint wraps, and a segment wraps several (torch's own check still runs)",
            "drop one of the two",
        ))
    return problems + segment_problems(config.segments) + _check_bool("offload", config.offload)


def _budget_problems(config: FullConfig) -> list[Problem]:
    """``ckpt.budget`` on ckpt=full: what ``ckpt.segments=optimal`` plans for, required there and only there."""
    segments, budget = config.segments, config.budget
    if segments != "optimal":
        if budget is None:
            return []
        shown = "null" if segments is None else segments
        return [Problem(
            "ckpt.budget", f"ckpt.budget={budget!r} is only read with ckpt.segments=optimal, not ckpt.segments={shown}",
            "set ckpt.segments=optimal (the least recomputation that fits the budget), or drop ckpt.budget "
            "(ckpt=auto takes a budget too: it chooses per layer)",
        )]
    if budget is None:
        return [Problem(
            "ckpt.budget", "ckpt.segments=optimal needs ckpt.budget: a fraction of the activation peak without "
            "checkpointing (0.3) or a size (2GiB)",
            "or choose ckpt.segments=sqrt or recursive, which need no budget",
        )]
    try:
        parse_budget(budget)
    except ConfigError as err:
        return err.problems
    return []


def _compile_problems(config: Any) -> list[Problem]:
    """``ckpt.compile``: true (inductor), false or a backend name, and not with what has no one call to compile."""
    value = config.compile
    if isinstance(value, str):
        from ckpt_plugin.config.values import backends

        names = backends()
        if value not in names:
            near = ", ".join(repr(b) for b in closest_first(value, names)[:5])
            return [Problem(
                "ckpt.compile", f"ckpt.compile={value!r} is not a torch.compile backend",
                f"give true (inductor), false or a backend name; closest first: {near}, ... "
                "(torch.compiler.list_backends(exclude_tags=()) lists them all)",
            )]
    elif not isinstance(value, bool):
        return [Problem(
            "ckpt.compile",
            f"ckpt.compile={value!r} ({type(value).__name__}) must be true (inductor), false or the name of a "
            "torch.compile backend",
        )]
    if value is False:
        return []
    on = f"ckpt.compile={str(value).lower() if value is True else value}"
    problems = []
    segments = getattr(config, "segments", None)
    if segments is not None:
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.segments={segments}: a segment is one checkpoint over several "
            "layers' calls, opened in the first layer's forward pre-hook and closed in the last one's forward "
            "hook, so there is no one call to compile",
            "drop ckpt.segments (each layer is then its own compiled checkpoint), or drop ckpt.compile",
        ))
    if getattr(config, "deepspeed", None) is not None:
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.deepspeed (DeepSpeed's own checkpoint): torch.compile captures "
            "torch's checkpoint as one region, not DeepSpeed's reentrant autograd Function",
            "drop ckpt.compile, or drop ckpt.deepspeed (ckpt=full: torch's checkpoint, which compiles)",
        ))
    if getattr(config, "check_recompute", False) is True:
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.check_recompute=true: compiled, a layer's recomputation is part "
            "of its compiled backward graph, not a second run of its forward, so there is nothing to check",
            "drop one of the two",
        ))
    if getattr(config, "policy", None) == "names":
        problems.append(Problem(
            "ckpt.compile",
            f"{on} cannot be combined with ckpt.policy=names: checkpoint_name tags are emitted only in the "
            "plugin's eager selective modes, which torch.compile replaces by torch's, so no tag would be saved",
            "use ckpt.policy=matmuls or a list of aten ops (these compile), or drop ckpt.compile",
        ))
    return problems


@dataclass(kw_only=True)
class FullConfig(LayerSelection):
    """``ckpt=full``: non-reentrant ``torch.utils.checkpoint`` around each selected module."""

    mode: str = "full"
    # Replay the forward's RNG state on recompute so dropout masks match (torch's default).
    preserve_rng_state: bool = True
    # Name the module whose recomputation saves tensors of another shape, dtype or device than its
    # forward (RecomputationMismatch). Off: torch checks the same, unnamed, without a hook per saved tensor.
    check_recompute: bool = False
    # null: one checkpoint per layer; S, 'sqrt' or 'recursive': checkpointed segments of the chain;
    # 'optimal': the nesting of regions with the least recomputation that fits ckpt.budget (Rotor).
    segments: Any = None
    # With segments=optimal only: a fraction of the activation peak without checkpointing (0.3), a
    # size (2GiB) or min (the least peak any nesting reaches), read as ckpt=auto reads its budget.
    budget: Any = None
    # Keep what checkpointing still saves (the layers' inputs) in CPU memory.
    offload: bool = False
    # null: torch's checkpoint. DeepSpeed's own checkpoint and its options (ckpt=deepspeed): a mapping
    # of partition_activations, cpu_checkpointing, contiguous_memory_optimization, number_checkpoints,
    # synchronize_checkpoint_boundary, profile.
    deepspeed: Any = None
    # Run each selected layer compiled, its checkpoint included (regional compilation, torchtitan's
    # per-block compile): true (inductor), false, or a torch.compile backend's name (aot_eager).
    compile: Any = False

    def __post_init__(self) -> None:
        raise_problems(_checkpointing_problems(self) + _budget_problems(self) + self._deepspeed_problems()
                       + _compile_problems(self))

    def _deepspeed_problems(self) -> list[Problem]:
        try:
            self.deepspeed = settings_of(self.deepspeed)
        except ConfigError as err:
            return err.problems
        if self.deepspeed is None:
            return []
        problems = self.deepspeed.problems()
        with_ds = "with ckpt.deepspeed (DeepSpeed's own checkpoint)"
        if self.segments is not None:
            problems.append(Problem("ckpt.segments", f"ckpt.segments={self.segments} cannot be combined {with_ds}: "
                                    "it checkpoints layer by layer", "drop ckpt.segments"))
        if self.offload is True:
            problems.append(Problem("ckpt.offload", f"ckpt.offload=true cannot be combined {with_ds}: use "
                                    "ckpt.deepspeed.cpu_checkpointing=true (with partition_activations=true)"))
        if self.preserve_rng_state is False:
            problems.append(Problem("ckpt.preserve_rng_state", f"ckpt.preserve_rng_state=false cannot be combined "
                                    f"{with_ds}: DeepSpeed's checkpoint always replays the RNG state"))
        if self.check_recompute is True:
            problems.append(Problem("ckpt.check_recompute", f"ckpt.check_recompute=true cannot be combined "
                                    f"{with_ds}: DeepSpeed's (reentrant) checkpoint has no place for the check"))
        return problems


@dataclass(kw_only=True)
class SelectiveConfig(LayerSelection):
    """``ckpt=selective``: save the outputs of chosen ops, recompute the rest (torch's SAC)."""

    mode: str = "selective"
    # 'matmuls', 'matmuls_no_batch', 'names', or a list of aten op names ([aten.mm, aten.addmm]).
    policy: Any = "matmuls"
    # With policy=names: save exactly the checkpoint_name tensors named here ...
    save_names: Any = None
    # ... or every named tensor except these.
    exclude_names: Any = None
    preserve_rng_state: bool = True
    check_recompute: bool = False
    segments: Any = None
    offload: bool = False
    compile: Any = False

    def __post_init__(self) -> None:
        from ckpt_plugin.engine.policies import make_policy

        problems = _checkpointing_problems(self)
        if self.segments == "optimal":
            problems.append(Problem(
                "ckpt.segments",
                "ckpt.segments=optimal is planned for ckpt=full's regions, which keep only their inputs: a selective "
                "region also keeps the outputs of the ops its policy saves, which the schedule's memory model does "
                "not count",
                "use ckpt=full ckpt.segments=optimal ckpt.budget=..., or with ckpt=selective an integer, sqrt or "
                "recursive",
            ))
        try:
            make_policy(self.policy, save_names=self.save_names, exclude_names=self.exclude_names)
        except ConfigError as err:
            problems += err.problems
        raise_problems(problems + _compile_problems(self))


@dataclass(kw_only=True)
class OffloadConfig(LayerSelection):
    """``ckpt=offload``: no recompute; what the selected layers save lives in CPU memory."""

    mode: str = "offload"
    # Run each selected layer compiled (no checkpoint to compile here: the layer alone).
    compile: Any = False

    def __post_init__(self) -> None:
        raise_problems(self._problems() + _compile_problems(self))


@dataclass(kw_only=True)
class AutoConfig(LayerSelection):
    """``ckpt=auto``: per layer keep, selective (two policies) or full, the least recompute that fits a budget."""

    mode: str = "auto"
    # A fraction of the activation peak without checkpointing (0.4), a size (2GiB), or min (the least
    # peak the planner reaches). Required.
    budget: Any = None
    preserve_rng_state: bool = True
    # Run each layer the plan checkpoints compiled, its checkpoint included.
    compile: Any = False
    # How each option is timed for the plan: auto (as the step runs: compiled where ckpt.compile or the
    # user's torch.compile will compile it), eager, compiled (inductor) or a torch.compile backend's name.
    timing: Any = "auto"
    # A plan file (the ckpt_plan.json a ckpt=auto run writes in its log dir): install exactly that plan,
    # without planning (no profile, no timing); layers and budget are then not needed. null: plan.
    plan: Any = None

    def __post_init__(self) -> None:
        given = self.plan is not None  # the file decides what is wrapped: layers and budget may be left out
        problems = [p for p in self._problems() if not (given and self.layers is None and p.key == "ckpt.layers")]
        problems += _check_bool("preserve_rng_state", self.preserve_rng_state) + _plan_problems(self.plan)
        if not (given and self.budget is None):
            try:
                parse_budget(self.budget)
            except ConfigError as err:
                problems += err.problems
        raise_problems(problems + _compile_problems(self) + _timing_problems(self.timing))


def _plan_problems(value: Any) -> list[Problem]:
    """``ckpt.plan``: null, or the path of a file that exists (its content is checked against the model)."""
    import os

    if value is None:
        return []
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        return [Problem("ckpt.plan", f"ckpt.plan={value!r} ({type(value).__name__}) must be the path of a plan file "
                        "(the ckpt_plan.json a ckpt=auto run writes in its log dir), or null to plan")]
    if not os.path.isfile(value):
        return [Problem("ckpt.plan", f"ckpt.plan={os.fspath(value)}: no such file",
                        "give the path of a ckpt_plan.json that a ckpt=auto run wrote (in its log dir), "
                        "or null to plan")]
    return []


TIMINGS = ("auto", "eager", "compiled")


def _timing_problems(value: Any) -> list[Problem]:
    """``ckpt.timing``: auto, eager, compiled, or a torch.compile backend's name."""
    if not isinstance(value, str):
        return [Problem("ckpt.timing", f"ckpt.timing={value!r} ({type(value).__name__}) must be one of "
                        f"{_quote_all(TIMINGS)} or the name of a torch.compile backend")]
    if value in TIMINGS:
        return []
    from ckpt_plugin.config.values import backends

    names = backends()
    if value in names:
        return []
    near = ", ".join(repr(b) for b in closest_first(value, [*TIMINGS, *names])[:5])
    return [Problem(
        "ckpt.timing", f"ckpt.timing={value!r} is neither {_quote_all(TIMINGS)} nor a torch.compile backend",
        f"closest first: {near}, ... (torch.compiler.list_backends(exclude_tags=()) lists the backends)",
    )]


@dataclass(kw_only=True)
class NoneConfig:
    """``ckpt=none``: train without checkpointing.

    It accepts (and ignores) the keys of every other mode, so that ``ckpt=none``
    can be added to any command line that sets ``ckpt.*``, for an A/B run.
    Nothing is wrapped, so no value can be wrong.
    """

    mode: str = "none"
    layers: Any = None
    every_n: Any = 1
    preserve_rng_state: Any = True
    check_recompute: Any = False
    segments: Any = None
    offload: Any = False
    policy: Any = None
    save_names: Any = None
    exclude_names: Any = None
    budget: Any = None
    deepspeed: Any = None
    compile: Any = False
    timing: Any = None
    plan: Any = None


MODES: dict[str, type] = {
    "full": FullConfig,
    "selective": SelectiveConfig,
    "offload": OffloadConfig,
    "auto": AutoConfig,
    "none": NoneConfig,
}

CkptConfig = FullConfig | SelectiveConfig | OffloadConfig | AutoConfig | NoneConfig


def user_keys(cls: type) -> list[str]:
    """The keys a user may set for one mode (``mode`` aside: it chose the class)."""
    return [f.name for f in fields(cls) if f.name != "mode"]


def make_config(**keys: Any) -> CkptConfig:
    """Build and validate the config of one mode from the keys of the ``ckpt`` node."""
    keys.pop("_target_", None)
    mode = keys.pop("mode", "full")
    if mode not in MODES:
        raise ConfigError([Problem(
            "ckpt.mode", f"ckpt.mode={mode!r} is not a mode",
            f"valid modes, closest first: {_quote_all(closest_first(str(mode), MODES))}",
        )])
    cls = MODES[mode]
    valid = user_keys(cls)
    problems: list[Problem] = []
    for key in (k for k in keys if k not in valid):
        near = difflib.get_close_matches(key, valid, n=1)
        problems.append(Problem(
            f"ckpt.{key}",
            f"unknown key ckpt.{key}" + (f" (did you mean ckpt.{near[0]}?)" if near else "")
            + f" for ckpt mode {mode!r}",
            f"valid keys: {', '.join(valid)}",
        ))
    try:
        config = cls(**{k: _plain(v) for k, v in keys.items() if k in valid})
    except ConfigError as err:  # the values' problems, reported with the keys' problems
        if not problems:
            raise
        problems += err.problems
    raise_problems(problems)
    return config


def _plain(value: Any) -> Any:
    """OmegaConf containers (from Hydra) to plain Python, so checks see lists and dicts."""
    if type(value).__module__.startswith("omegaconf"):  # only a Hydra user hands us these
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def as_keys(config: CkptConfig) -> dict[str, Any]:
    """The inverse of :func:`make_config`: keyword arguments that rebuild ``config``."""
    return asdict(config)


__all__ = [
    "AutoConfig",
    "FullConfig",
    "OffloadConfig",
    "SelectiveConfig",
    "LayerSelection",
    "MODES",
    "CkptConfig",
    "NoneConfig",
    "as_keys",
    "make_config",
    "user_keys",
]

