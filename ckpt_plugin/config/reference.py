"""The key reference of the docs, generated: every key of the ``ckpt`` node, the modes that take it, its
default in each, and what it means (:data:`~ckpt_plugin.config.keys.HELP`). The docs' hook calls
:func:`markdown`; nothing else writes that table."""

from __future__ import annotations

from dataclasses import MISSING, fields

from ckpt_plugin.config.keys import HELP
from ckpt_plugin.config.schema import MODES

_NO_KEYS = ("none",)  # ckpt=none accepts every key and reads none: not listed as "taking" them


def _shown(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def markdown() -> str:
    """One markdown table: key, the modes that take it (with the default in each where they differ), meaning."""
    rows = ["| key | modes (default) | meaning |", "|---|---|---|"]
    for key, text in HELP.items():
        if key == "mode":
            modes = ", ".join(f"`{m}`" for m in MODES)
            rows.append(f"| `mode` | {modes} (`full`) | {text} |")
            continue
        taking = {mode: next(f for f in fields(cls) if f.name == key)
                  for mode, cls in MODES.items() if mode not in _NO_KEYS and key in {f.name for f in fields(cls)}}
        defaults = {mode: ("required" if f.default is None and key in ("layers",) else _shown(f.default))
                    for mode, f in taking.items() if f.default is not MISSING}
        if len(set(defaults.values())) == 1:
            modes = f"{', '.join(f'`{m}`' for m in taking)} (`{next(iter(defaults.values()))}`)"
        else:
            modes = ", ".join(f"`{m}` (`{d}`)" for m, d in defaults.items())
        meaning = text.replace("|", r"\|")  # a pipe would end the cell
        rows.append(f"| `{key}` | {modes} | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
