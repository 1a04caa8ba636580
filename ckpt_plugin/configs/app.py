"""What a Hydra training app calls around its body: early checks and short errors.

    @hydra.main(config_path="configs", config_name="train", version_base="1.3")
    def main(cfg):
        with config_errors_exit():      # a ckpt mistake: the message alone, exit code 2
            check_app_config(cfg)       # before the model and the data are built
            train(cfg)

:func:`check_app_config` checks, on the composed config alone, everything
about the plugin that needs no model: every ``ckpt`` key and value (the same
checks the callback makes when it is built), and that ``ckpt.deepspeed`` (DeepSpeed's
own checkpoint) comes with a DeepSpeed ``trainer.strategy``. What needs the
model (do the layers exist? enough of them for ``ckpt.segments``?) is checked by
the callback in ``setup``, before ``configure_optimizers`` and the first batch.

:func:`config_errors_exit` turns a :class:`~ckpt_plugin.errors.ConfigError`
raised inside it into what a command-line tool prints for a usage error: the
message alone on stderr and exit code 2 (argparse's), instead of ~20 lines of
Lightning and Hydra traceback around one line that matters.
``HYDRA_FULL_ERROR=1`` re-raises it with the whole traceback, as Hydra does for
its own errors.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from ckpt_plugin.configs import CALLBACK_TARGET
from ckpt_plugin.config.schema import make_config
from ckpt_plugin.errors import ConfigError, Problem, raise_problems


def _plain(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def ckpt_nodes(cfg: Any) -> dict[str, dict]:
    """The ``callbacks`` entries that build this plugin's callback, as plain dicts (by their key)."""
    callbacks = _plain(cfg.get("callbacks") or {})
    return {
        name: node for name, node in callbacks.items()
        if isinstance(node, dict) and node.get("_target_") == CALLBACK_TARGET
    }


def _deepspeed_strategy(cfg: Any) -> tuple[bool | None, str]:
    """Whether ``trainer.strategy`` is DeepSpeed's (None: cannot tell from the config), and its name."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    trainer = cfg.get("trainer") or {}
    strategy = _plain(trainer.get("strategy", "auto"))
    if isinstance(strategy, dict):
        try:
            from hydra.utils import get_class

            cls = get_class(str(strategy["_target_"]))
        except Exception:  # an unusual node: the callback checks the built strategy at fit start
            return None, str(strategy)
        return issubclass(cls, DeepSpeedStrategy), cls.__name__
    name = str(strategy)
    if name == "auto":  # Lightning's auto never picks DeepSpeed
        return False, "auto"
    if name in StrategyRegistry:
        return issubclass(StrategyRegistry[name]["strategy"], DeepSpeedStrategy), name
    return None, name


def check_app_config(cfg: Any) -> None:
    """Raise one :class:`ConfigError` for every plugin mistake visible in the composed ``cfg``."""
    problems: list[Problem] = []
    for node in ckpt_nodes(cfg).values():
        try:
            config = make_config(**node)
        except ConfigError as err:
            problems += err.problems
            continue
        if getattr(config, "deepspeed", None) is None:
            continue
        deepspeed, strategy = _deepspeed_strategy(cfg)
        if deepspeed is False:
            problems.append(Problem(
                "ckpt.deepspeed",
                f"ckpt.deepspeed is set (ckpt=deepspeed: DeepSpeed's own checkpoint) but trainer.strategy is "
                f"{strategy!r}, not a DeepSpeed strategy",
                "choose trainer=deepspeed_zero1/2/3, or another ckpt preset (torch's checkpoint works under "
                "every strategy)",
            ))
    raise_problems(problems)


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


__all__ = ["check_app_config", "ckpt_nodes", "config_errors_exit"]
