"""Hydra search-path plugin: makes ``callbacks: activation_checkpointing`` and the
``ckpt`` presets resolve in any Hydra app of an environment where ckpt-plugin is
installed.

Hydra imports every module under the ``hydra_plugins`` namespace package when an
app starts, whatever the app. So this costs next to nothing and adds only what is
the plugin's: it appends ``pkg://ckpt_plugin.config`` (the ``ckpt`` group and
``callbacks/activation_checkpointing``, nothing else) to the config search path,
after the app's own configs, which therefore win on a name clash, and registers
the typed ``ckpt`` schemas with the ConfigStore. It imports no torch and no
Lightning: those load only when the app instantiates the callback.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from ckpt_plugin.config.hydra import register_configs

register_configs()


class CkptPluginSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="ckpt-plugin", path="pkg://ckpt_plugin.config")
