"""mkdocs hooks: the pages written from the code, so that nothing is said twice.

- ``keys.md``: the marker ``<!-- ckpt keys -->`` becomes the table of every ``ckpt`` key
  (the modes that take it, its default, its help), read from the config dataclasses by
  ``ckpt_plugin.config.reference.markdown()``. A key is documented where it is declared.
- ``api.md``: the marker ``<!-- ckpt_plugin.__all__ -->`` becomes one mkdocstrings entry per
  public name, at the module that defines it (``ckpt_plugin._WHERE``), so a name that moves
  between modules moves on the page too, and a public name without a page cannot exist.
"""

from __future__ import annotations

import ckpt_plugin

KEYS_MARKER = "<!-- ckpt keys -->"
API_MARKER = "<!-- ckpt_plugin.__all__ -->"


def _keys_table() -> str:
    from ckpt_plugin.config.reference import markdown  # torch-free: the schema's dataclasses only

    return markdown()


def _api_entries() -> str:
    # ckpt_plugin imports its names lazily (PEP 562): _WHERE says where each one is defined.
    return "\n\n".join(f"::: {ckpt_plugin._WHERE[name]}.{name}" for name in ckpt_plugin.__all__)


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, make in ((KEYS_MARKER, _keys_table), (API_MARKER, _api_entries)):
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
