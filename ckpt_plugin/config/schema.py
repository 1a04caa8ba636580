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
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

from ckpt_plugin.config.budget import Budget, parse_budget
from ckpt_plugin.config.deepspeed import DeepSpeedCheckpointing, settings_of
from ckpt_plugin.config.keys import HELP
from ckpt_plugin.config.memory import Memory, batch_problems, parse_memory
from ckpt_plugin.config.values import compile_problems, every_n_problems, read_layers, timing_problems
from ckpt_plugin.errors import ConfigError, Problem, closest_first, raise_problems

if TYPE_CHECKING:  # config/policy.py loads torch: the schema imports it only to check a selective config
    from ckpt_plugin.config.policy import PolicySpec



def _quote_all(items: Iterable[str]) -> str:
    return ", ".join(repr(i) for i in items)


@dataclass(kw_only=True)
class LayerSelection:
    """Which modules to checkpoint; shared by every mode that wraps modules.

    What each key means is written once, in ``keys.py``. ``layers`` is None (YAML null)
    until the user names them, so that our message, not Hydra's, says it is required.
    """

    layers: str | Sequence[str] | None = None  # read into a tuple of entries
    every_n: int = 1
    sample: str = "step"  # what measuring runs: step (the trainer's training_step), forward, or none

    # Values read into their types when the config is built (never again). Class attributes, not annotated: not
    # keys, so not fields (as_keys, Hydra's node and the callback's signature see only the keys).
    _budget = None  # Budget | None
    _memory = None  # Memory | None
    _policy = None  # PolicySpec | None

    @property
    def read_budget(self) -> Budget | None:
        """``ckpt.budget`` as read when this config was built; None where the mode has none or it was not given."""
        return self._budget

    @property
    def read_memory(self) -> Memory | None:
        """``ckpt.memory`` as read when this config was built; None where the mode has none or it was not given."""
        return self._memory

    @property
    def read_policy(self) -> PolicySpec | None:
        """``ckpt.policy`` with its names, as read when this ``ckpt=selective`` config was built."""
        return self._policy

    def _read_selection(self) -> list[Problem]:
        """Read ``layers`` into a tuple of stripped entries, the form every later step uses; the problems of
        ``layers`` and ``every_n``."""
        layers, problems = read_layers(self.layers)
        if layers is not None:
            self.layers = layers
        return problems + every_n_problems(self.every_n) + sample_problems(self.sample)


SAMPLES = ("step", "forward", "none")  # ckpt.sample's values (lightning/step.py says what each runs)


def sample_problems(value: Any) -> list[Problem]:
    """``ckpt.sample``: one of :data:`SAMPLES`."""
    if isinstance(value, str) and value in SAMPLES:
        return []
    return [Problem("ckpt.sample", f"ckpt.sample={value!r} is not one of {', '.join(SAMPLES)}",
                    "step: the trainer's training_step on the first batch (the default); forward: the module's "
                    "forward on example_input_array; none: measure nothing (fixed modes)")]


def _check_bool(key: str, value: Any) -> list[Problem]:
    if isinstance(value, bool):
        return []
    return [Problem(f"ckpt.{key}", f"ckpt.{key}={value!r} ({type(value).__name__}) must be true or false")]


def _checkpointing_problems(config: FullConfig | SelectiveConfig) -> list[Problem]:
    """What full and selective check alike: the layers, preserve_rng_state, check_recompute, segments, offload."""
    from ckpt_plugin.config.values import segment_problems

    problems = config._read_selection() + _check_bool("preserve_rng_state", config.preserve_rng_state)
    problems += _check_bool("check_recompute", config.check_recompute)
    if config.check_recompute is True and config.segments is not None:
        problems.append(Problem(
            "ckpt.check_recompute",
            f"ckpt.check_recompute=true cannot be combined with ckpt.segments={config.segments}: it names the "
            "one module a checkpoint wraps, and a segment wraps several (torch's own check still runs)",
            "drop one of the two",
        ))
    return problems + segment_problems(config.segments) + _check_bool("offload", config.offload)


def _read_budget(budget: Any) -> tuple[Budget | None, list[Problem]]:
    """``ckpt.budget`` read (``config/budget.py``), and its problems."""
    try:
        return parse_budget(budget), []
    except ConfigError as err:
        return None, err.problems


def _unset(value: Any) -> bool:
    """A key left out: null, ``???`` (OmegaConf's MISSING, as a preset may leave it) or blank."""
    return value is None or (isinstance(value, str) and value.strip() in ("", "???"))


def _read_memory(memory: Any) -> tuple[Memory | None, list[Problem]]:
    """``ckpt.memory`` read (``config/memory.py``), and its problems."""
    try:
        return parse_memory(memory), []
    except ConfigError as err:
        return None, err.problems


def _read_optimal_budget(segments: Any, budget: Any) -> tuple[Budget | None, list[Problem]]:
    """``ckpt.budget`` on ckpt=full: what ``ckpt.segments=optimal`` plans for, required there and only there."""
    if segments != "optimal":
        if budget is None:
            return None, []
        shown = "null" if segments is None else segments
        return None, [Problem(
            "ckpt.budget", f"ckpt.budget={budget!r} is only read with ckpt.segments=optimal, not ckpt.segments={shown}",
            "set ckpt.segments=optimal (the least recomputation that fits the budget), or drop ckpt.budget "
            "(ckpt=auto takes a budget too: it chooses per layer)",
        )]
    if budget is None:
        return None, [Problem(
            "ckpt.budget", "ckpt.segments=optimal needs ckpt.budget: a fraction of the activation peak without "
            "checkpointing (0.3) or a size (2GiB)",
            "or choose ckpt.segments=sqrt or recursive, which need no budget",
        )]
    return _read_budget(budget)


@dataclass(kw_only=True)
class _Recomputing(LayerSelection):
    """The keys of the modes that recompute, ``full`` and ``selective``."""

    mode: str
    preserve_rng_state: bool = True
    check_recompute: bool = False
    segments: int | str | None = None  # a count, sqrt, recursive or optimal
    offload: bool = False
    compile: bool | str = False  # true (inductor), false or a backend's name


@dataclass(kw_only=True)
class FullConfig(_Recomputing):
    """``ckpt=full``: non-reentrant ``torch.utils.checkpoint`` around each selected module."""

    mode: str = "full"
    budget: float | int | str | None = None  # read into a Budget (read_budget)
    deepspeed: DeepSpeedCheckpointing | Mapping[str, Any] | None = None  # read into DeepSpeedCheckpointing

    def __post_init__(self) -> None:
        self._budget, budget_problems = _read_optimal_budget(self.segments, self.budget)
        try:
            self.deepspeed = settings_of(self.deepspeed)  # read into DeepSpeedCheckpointing (or None)
            deepspeed_problems = self._deepspeed_problems()
        except ConfigError as err:
            deepspeed_problems = err.problems
        raise_problems(_checkpointing_problems(self) + budget_problems + deepspeed_problems + compile_problems(self))

    def _deepspeed_problems(self) -> list[Problem]:
        """What ``ckpt.deepspeed`` (already read) cannot be combined with."""
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
class SelectiveConfig(_Recomputing):
    """``ckpt=selective``: save the outputs of chosen ops, recompute the rest (torch's SAC)."""

    mode: str = "selective"
    policy: str | Sequence[str] = "matmuls"  # read, with the names, into a PolicySpec (read_policy)
    save_names: str | Sequence[str] | None = None
    exclude_names: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        from ckpt_plugin.config.policy import read_policy  # loads torch: only when a selective config is checked

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
            self._policy = read_policy(self.policy, save_names=self.save_names, exclude_names=self.exclude_names)
        except ConfigError as err:
            problems += err.problems
        raise_problems(problems + compile_problems(self))


@dataclass(kw_only=True)
class OffloadConfig(LayerSelection):
    """``ckpt=offload``: no recompute; what the selected layers save lives in CPU memory."""

    mode: str = "offload"
    compile: bool | str = False

    def __post_init__(self) -> None:
        raise_problems(self._read_selection() + compile_problems(self))


@dataclass(kw_only=True)
class AutoConfig(LayerSelection):
    """``ckpt=auto``: per layer keep, selective (two policies) or full, the least recompute that fits a budget
    (the activations) or a memory (the whole step, with ckpt.batch=max the largest batch that does)."""

    mode: str = "auto"
    budget: float | int | str | None = None  # read into a Budget (read_budget)
    memory: float | int | str | None = None  # read into a Memory (read_memory); instead of budget
    batch: str | None = None  # null (the dataloader's) or max (the largest that fits memory)
    preserve_rng_state: bool = True
    compile: bool | str = False
    timing: str = "auto"  # auto, eager, compiled or a backend's name
    plan: str | os.PathLike | None = None  # a plan file's path
    offload: bool = True  # layers may keep in host memory what they save, where a host link is measured (a GPU)

    def __post_init__(self) -> None:
        given = self.plan is not None  # the file decides what is wrapped: layers and budget (or memory) may be unset
        problems = [p for p in self._read_selection() if not (given and self.layers is None and p.key == "ckpt.layers")]
        problems += _check_bool("preserve_rng_state", self.preserve_rng_state) + _plan_problems(self.plan)
        problems += _check_bool("offload", self.offload)
        if self.sample == "none" and self.plan is None:
            problems.append(Problem("ckpt.sample", "ckpt.sample=none measures nothing, and ckpt=auto plans by "
                                    "measuring the step", "ckpt.sample=step (the default) or forward"))
        problems += self._read_fit()
        raise_problems(problems + compile_problems(self) + timing_problems(self.timing))

    def _read_fit(self) -> list[Problem]:
        """Read what the plan fits, into ``_budget`` or ``_memory``, and its problems: one of ckpt.budget (the
        activations) and ckpt.memory (the whole step), never both, and neither with a plan file; ckpt.batch=max
        searches against the memory."""
        budget, memory = not _unset(self.budget), not _unset(self.memory)
        problems: list[Problem] = []
        if memory:
            self._memory, problems = _read_memory(self.memory)
        if budget or not (memory or self.plan is not None):  # unset, its read is the "needs ckpt.budget" problem
            self._budget, more = _read_budget(self.budget)
            problems += more
        if budget and memory:
            problems.append(Problem(
                "ckpt.memory",
                f"ckpt.memory={self.memory!r} cannot be combined with ckpt.budget={self.budget!r}: ckpt.budget is "
                "the activation memory alone (a share of the peak without checkpointing, or a size), ckpt.memory "
                "the device memory the whole step must fit on one rank (parameters, gradients, optimizer state, "
                "activations)",
                "drop one of the two",
            ))
        return problems + batch_problems(self.batch, memory)


def _plan_problems(value: Any) -> list[Problem]:
    """``ckpt.plan``: null, or the path of a file that exists (its content is checked against the model)."""
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


# ckpt=none's keys: every other mode's, with what it shows for them (it reads none of them).
_NONE_KEYS = {"layers": None, "every_n": 1, "sample": "step", "preserve_rng_state": True, "check_recompute": False, "segments": None,
              "offload": False, "policy": None, "save_names": None, "exclude_names": None, "budget": None,
              "memory": None, "batch": None, "deepspeed": None, "compile": False, "timing": None, "plan": None}
NoneConfig = make_dataclass(
    "NoneConfig", [("mode", str, field(default="none")), *((k, Any, field(default=v)) for k, v in _NONE_KEYS.items())],
    kw_only=True)
NoneConfig.__module__ = __name__  # make_dataclass names its caller's module only from Python 3.12
NoneConfig.__doc__ = """``ckpt=none``: train without checkpointing.

    It accepts (and ignores) the keys of every other mode, so that ``ckpt=none``
    can be added to any command line that sets ``ckpt.*``, for an A/B run.
    Nothing is wrapped, so no value can be wrong.
    """


MODES: dict[str, type] = {
    "full": FullConfig,
    "selective": SelectiveConfig,
    "offload": OffloadConfig,
    "auto": AutoConfig,
    "none": NoneConfig,
}

CkptConfig = FullConfig | SelectiveConfig | OffloadConfig | AutoConfig | NoneConfig


def user_keys(cls: type) -> list[str]:
    """The keys a user may set for one mode (``mode`` aside: it chose the class), in the order ``keys.py`` gives
    every key, so that each mode lists its keys alike."""
    own = {f.name for f in fields(cls)}
    return [key for key in HELP if key in own and key != "mode"]


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

