"""What a Hydra training app calls around its body: early checks and short errors.

    @hydra.main(config_path="configs", config_name="train", version_base="1.3")
    def main(cfg):
        with config_errors_exit():      # a ckpt mistake: the message alone, exit code 2
            check_app_config(cfg)       # before the model and the data are built
            train(cfg)

:func:`check_app_config` checks, on the composed config alone, everything
about the plugin that needs no model: every ``ckpt`` key and value (the same
checks the callback makes when it is built, after every interpolation in them
resolves), that the ``ckpt`` node still builds the plugin's callback
(``_target_``), and that ``ckpt.deepspeed`` (DeepSpeed's own checkpoint) comes
with a DeepSpeed strategy: the ``trainer`` node's, or the Trainer's when the app
builds it in Python and passes it (``check_app_config(cfg, trainer)``). What
needs the model (do the layers exist? enough of them for ``ckpt.segments``?) is
checked by the callback in ``setup``, before ``configure_optimizers`` and the
first batch.

:func:`config_errors_exit` turns a :class:`~ckpt_plugin.errors.ConfigError`
raised inside it into what a command-line tool prints for a usage error: the
message alone on stderr and exit code 2 (argparse's), instead of ~20 lines of
Lightning and Hydra traceback around one line that matters.
``HYDRA_FULL_ERROR=1`` re-raises it with the whole traceback, as Hydra does for
its own errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from ckpt_plugin.config.schema import MODES, make_config, user_keys
from ckpt_plugin.config.hydra import CALLBACK_TARGET
from ckpt_plugin.errors import ConfigError, Problem, raise_problems

log = logging.getLogger("ckpt_plugin")

_KEYS = {key for cls in MODES.values() for key in user_keys(cls)}  # the keys the callback takes, mode aside

_PRESET_FIX = ("choose a preset with ckpt=<name> (full, selective, offload, auto, deepspeed, none, ...) and set "
               "its keys with ckpt.<key>=<value>")


def _resolved(node: Any, prefix: str) -> tuple[dict, list[Problem]]:
    """``node``'s keys, each resolved to plain Python; an interpolation that does not resolve is a problem.

    ``???`` (OmegaConf's missing value) stays ``"???"``: the schema says which key it is and what it needs.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    if not OmegaConf.is_config(node):
        return dict(node), []
    raw = OmegaConf.to_container(node, resolve=False)
    keys: dict[str, Any] = {}
    problems: list[Problem] = []
    for key in raw:
        try:
            value = node[key]
            keys[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except MissingMandatoryValue:
            keys[key] = "???"
        except OmegaConfBaseException as err:
            full_key = getattr(err, "full_key", None) or f"{prefix}.{key}"
            path = full_key.split(".")[len(prefix.split(".")):] if full_key.startswith(f"{prefix}.") else [key]
            given: Any = raw
            for part in path:
                given = given.get(part) if isinstance(given, dict) else given
            reason = (getattr(err, "msg", None) or str(err)).splitlines()[0]
            problems.append(Problem(
                full_key, f"{full_key}={given!r} does not resolve: {reason}",
                "set what the interpolation refers to, or give the value itself",
            ))
    return keys, problems


def _plugin_nodes(cfg: Any) -> tuple[dict[str, dict], list[Problem]]:
    """The nodes that build this plugin's callback, by their place (``ckpt``, ``callbacks.<name>``), resolved.

    The ``ckpt`` node is the plugin's when it has a ``mode`` (every preset sets one), whatever its
    ``_target_``: a changed one is refused, not skipped. A ``callbacks`` entry that interpolates it
    (``${ckpt}``) is the same node; any other entry is the plugin's when its ``_target_`` is the callback.
    """
    from omegaconf import OmegaConf

    nodes: dict[str, dict] = {}
    problems: list[Problem] = []
    ckpt = cfg.get("ckpt") if OmegaConf.is_dict(cfg) or isinstance(cfg, dict) else None
    if (OmegaConf.is_dict(ckpt) or isinstance(ckpt, dict)) and "mode" in ckpt:
        keys, unresolved = _resolved(ckpt, "ckpt")
        problems += unresolved
        target = keys.pop("_target_", None)
        if target != CALLBACK_TARGET:
            problems.append(Problem(
                "ckpt._target_",
                (f"ckpt._target_={target!r}" if target is not None else "ckpt._target_ is missing")
                + f": the ckpt node builds the plugin's callback, {CALLBACK_TARGET}, and its _target_ is not a "
                "setting",
                f"drop the override of ckpt._target_; {_PRESET_FIX}",
            ))
        if not unresolved:
            nodes["ckpt"] = keys
    callbacks = cfg.get("callbacks") if OmegaConf.is_dict(cfg) or isinstance(cfg, dict) else None
    if not (OmegaConf.is_dict(callbacks) or isinstance(callbacks, dict)):
        return nodes, problems
    raw = OmegaConf.to_container(callbacks, resolve=False) if OmegaConf.is_config(callbacks) else callbacks
    for name, node in raw.items():
        if isinstance(node, str) and node.replace(" ", "") == "${ckpt}":
            continue  # the ckpt node itself, checked above
        if not isinstance(node, dict) or node.get("_target_") != CALLBACK_TARGET:
            continue
        keys, unresolved = _resolved(callbacks[name], f"callbacks.{name}")
        problems += unresolved
        keys.pop("_target_", None)
        if not unresolved:
            nodes[f"callbacks.{name}"] = keys
    return nodes, problems


def ckpt_nodes(cfg: Any) -> dict[str, dict]:
    """The nodes that build this plugin's callback, as plain dicts without ``_target_`` (by their place)."""
    return _plugin_nodes(cfg)[0]


def _trainer_choices() -> list[str]:
    """The app's ``trainer`` presets with DeepSpeed in their name (the recipe's ``deepspeed_zero1``, ...), if any."""
    try:
        from hydra.core.global_hydra import GlobalHydra

        hydra = GlobalHydra.instance()
        if not hydra.is_initialized():
            return []
        return [o for o in hydra.config_loader().get_group_options("trainer") if "deepspeed" in o]
    except Exception:  # a Hydra without this API, or no group: the advice names the key instead
        return []


def _deepspeed_strategy(cfg: Any, trainer: Any) -> tuple[bool | None, str, str]:
    """Whether the strategy is DeepSpeed's (None: cannot tell), its name, and what to change if it is not."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    if trainer is not None:
        strategy = trainer.strategy
        return (isinstance(strategy, DeepSpeedStrategy), f"the Trainer's strategy is {type(strategy).__name__}",
                "build the Trainer with strategy='deepspeed_stage_1', '_2' or '_3' (or a DeepSpeedStrategy)")
    node = cfg.get("trainer")
    if node is None:
        return None, "", ""
    choices = _trainer_choices()
    listed = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else "".join(choices)
    fix = (f"choose trainer={listed}" if choices else
           "set trainer.strategy to a DeepSpeed strategy (deepspeed_stage_1, _2 or _3, or a DeepSpeedStrategy node)")
    strategy = node.get("strategy", "auto")
    from omegaconf import OmegaConf

    strategy = OmegaConf.to_container(strategy, resolve=True) if OmegaConf.is_config(strategy) else strategy
    if isinstance(strategy, dict):
        try:
            from hydra.utils import get_class

            cls = get_class(str(strategy["_target_"]))
        except Exception:  # an unusual node: the callback checks the built strategy at fit start
            return None, "", ""
        return issubclass(cls, DeepSpeedStrategy), f"trainer.strategy is {cls.__name__}", fix
    name = str(strategy)
    if name == "auto":  # Lightning's auto never picks DeepSpeed
        return False, "trainer.strategy is 'auto'", fix
    if name in StrategyRegistry:
        return issubclass(StrategyRegistry[name]["strategy"], DeepSpeedStrategy), f"trainer.strategy is {name!r}", fix
    return None, "", ""


def check_app_config(cfg: Any, trainer: Any = None) -> None:
    """Raise one :class:`ConfigError` for every plugin mistake visible in the composed ``cfg``.

    ``trainer``: the Trainer, for an app that builds it in Python rather than from a ``trainer``
    node: ``ckpt=deepspeed`` is then checked against its strategy. With neither, that check is
    left to the callback at fit start, and a log line says so.
    """
    nodes, problems = _plugin_nodes(cfg)
    for keys in nodes.values():
        # As the callback takes them: a null is the mode's default (a preset's `segments: null`), but a
        # key no mode has is refused whatever its value.
        keys = {k: v for k, v in keys.items() if v is not None or k not in _KEYS}
        try:
            config = make_config(**keys)
        except ConfigError as err:
            problems += err.problems
            continue
        # Read again as typed, where the config read them (auto's, optimal's): an integer below 1 MiB is a slip
        # for a fraction or a size.
        if getattr(config, "read_budget", None) is not None:
            from ckpt_plugin.config.budget import parse_budget

            try:
                parse_budget(config.budget, typed=True)
            except ConfigError as err:
                problems += err.problems
        if getattr(config, "read_memory", None) is not None:
            from ckpt_plugin.config.memory import parse_memory

            try:
                parse_memory(config.memory, typed=True)
            except ConfigError as err:
                problems += err.problems
        if getattr(config, "deepspeed", None) is None:
            continue
        deepspeed, strategy, fix = _deepspeed_strategy(cfg, trainer)
        if deepspeed is None:
            log.info("ckpt.deepspeed: the config has no trainer node that names a strategy and no Trainer was "
                     "passed (check_app_config(cfg, trainer)), so the strategy is checked when fitting starts")
        elif not deepspeed:
            problems.append(Problem(
                "ckpt.deepspeed",
                f"ckpt.deepspeed is set (ckpt=deepspeed: DeepSpeed's own checkpoint) but {strategy}, not a "
                "DeepSpeed strategy",
                f"{fix}; or choose another ckpt preset (torch's checkpoint works under every strategy)",
            ))
    raise_problems(problems)


def config_groups() -> str:
    """The running app's config groups and their options, one ``group: a, b`` line each, for ``--help``.

    As Hydra's ``$APP_CONFIG_GROUPS``, but with the groups the primary config adds through
    ``hydra.searchpath`` (Hydra lists only those of the app's own search path: hydra#1469), and
    without Hydra's own. An app's help template uses it through a resolver:
    ``OmegaConf.register_new_resolver("config_groups", config_groups)`` and ``${config_groups:}``.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    name = HydraConfig.get().job.config_name  # with it, the loader applies the primary config's searchpath

    def options(group: str, kind: ObjectType) -> list[str]:
        return sorted(loader.get_group_options(group, kind, config_name=name))

    lines, parents = [], [""]
    while parents:
        parent = parents.pop(0)
        for group in options(parent, ObjectType.GROUP):
            path = f"{parent}/{group}" if parent else group
            if path == "hydra":
                continue
            configs = options(path, ObjectType.CONFIG)
            if configs:
                lines.append(f"{path}: {', '.join(configs)}")
            parents.append(path)
    return "\n".join(sorted(lines))


def _config_error(err: BaseException) -> ConfigError | None:
    """``err`` or what it was raised from (Hydra's instantiate wraps errors of a ``_target_``), if a ConfigError."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, ConfigError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def config_errors_exit(stream: Any = None) -> Iterator[None]:
    """A plugin ``ConfigError`` inside: print it alone and exit 2 (``HYDRA_FULL_ERROR=1``: raise it)."""
    try:
        yield
    except Exception as exc:
        err = _config_error(exc)
        if err is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        out = stream or sys.stderr
        out.write(f"Error: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback.)\n")
        out.flush()
        raise SystemExit(2) from None


__all__ = ["check_app_config", "ckpt_nodes", "config_errors_exit", "config_groups"]
