"""What the plugin adds to a user's Hydra app: the ``ckpt`` presets, ``callbacks/activation_checkpointing``
and the typed schema they are checked against.

Hydra's search-path plugin (``hydra_plugins/ckpt_plugin_searchpath``) calls
:func:`register_configs` when any Hydra app starts, so this imports only the
schema (no torch, no Lightning). The schema classes know nothing of Lightning;
the node registered here adds the ``_target_`` that makes Hydra's
``instantiate`` build the callback from the ``ckpt`` node.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass

from ckpt_plugin.config.schema import MODES

CALLBACK_TARGET = "ckpt_plugin.ActivationCheckpointing"


def register_configs() -> None:
    """Register each mode's schema with Hydra's ConfigStore as ``ckpt_schema/<mode>``.

    The YAML presets in ``ckpt/`` list ``/ckpt_schema/<mode>@_here_`` first in
    their defaults, so Hydra type-checks every override against the dataclass.
    A group of their own keeps the schemas out of ``ckpt=``'s choices.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for mode, cls in MODES.items():
        node = make_dataclass(cls.__name__, [("_target_", str, field(default=CALLBACK_TARGET))], bases=(cls,), kw_only=True)
        store.store(group="ckpt_schema", name=mode, node=node, provider="ckpt_plugin")


__all__ = ["CALLBACK_TARGET", "register_configs"]
