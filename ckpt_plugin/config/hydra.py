"""What the plugin adds to a user's Hydra app: the ``ckpt`` presets, ``callbacks/activation_checkpointing``
and the schema nodes they are built on.

Hydra's search-path plugin (``hydra_plugins/ckpt_plugin_searchpath``) calls
:func:`register_configs` when any Hydra app starts, so this imports only the
schema (no torch, no Lightning). The schema classes know nothing of Lightning;
the node registered here adds the ``_target_`` that makes Hydra's
``instantiate`` build the callback from the ``ckpt`` node.
"""

from __future__ import annotations

from dataclasses import field, fields, make_dataclass
from typing import Any

from ckpt_plugin.config.schema import MODES

CALLBACK_TARGET = "ckpt_plugin.ActivationCheckpointing"
SCHEMA_PREFIX = "ckpt_plugin_schema_"  # ckpt_plugin_schema_full, ...: the presets' first default


def schema_node(cls: type) -> type:
    """The node Hydra builds a ``ckpt`` preset on: ``cls``'s keys, every value typed ``Any``, and the ``_target_``.

    The keys are fixed (the node is a struct: ``ckpt.foo=1`` is Hydra's error, ``+ckpt.foo=1`` ours),
    but no value is converted or judged by OmegaConf: its bool node reads ``2`` or ``yes`` as true and
    its int node ``'3'`` as 3. The values reach :func:`~ckpt_plugin.config.schema.make_config` as
    typed, which accepts only booleans for a boolean, and names the key, the value and the valid ones.
    """
    keys = [(f.name, Any, field(default=f.default)) for f in fields(cls)]
    return make_dataclass(cls.__name__, [*keys, ("_target_", str, field(default=CALLBACK_TARGET))], kw_only=True)


def register_configs() -> None:
    """Register each mode's schema node with Hydra's ConfigStore as ``ckpt_plugin_schema_<mode>``.

    The YAML presets in ``ckpt/`` list ``/ckpt_plugin_schema_<mode>@_here_`` first in their
    defaults. At the root, not in a group: ``--help`` lists groups, and these are not a choice.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for mode, cls in MODES.items():
        store.store(name=f"{SCHEMA_PREFIX}{mode}", node=schema_node(cls), provider="ckpt_plugin")


__all__ = ["CALLBACK_TARGET", "register_configs", "schema_node"]
