"""Hydra search-path plugin: makes ``callbacks: activation_checkpointing`` and the
``ckpt`` presets resolve in any Hydra app of an environment where ckpt-plugin is
installed.

Hydra imports every module under the ``hydra_plugins`` namespace package when an
app starts; this one appends ``pkg://ckpt_plugin.configs`` to the config search
path (after the app's own configs, which therefore win on a name clash),
registers the typed ``ckpt`` schemas with the ConfigStore and the resolvers the
configs use.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from ckpt_plugin.config import register_configs
from ckpt_plugin.resolvers import register_resolvers

register_configs()
register_resolvers()


class CkptPluginSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="ckpt-plugin", path="pkg://ckpt_plugin.configs")
