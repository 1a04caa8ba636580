"""The ``ckpt`` config, read once where it enters: the typed schema, one dataclass per mode
(``schema.py``), the values judged on their own (``budget.py``, ``values.py``, ``deepspeed.py``), each
key's meaning (``keys.py``; ``reference.py`` renders it for the docs), and what Hydra sees: the schema
nodes (``hydra.py``) and the YAML presets (``ckpt/``, ``callbacks/``), found at ``pkg://ckpt_plugin.config``.

The lowest layer above the base: it imports nothing of the engine, measure, planning or the spine, and
no framework at import time (Hydra's search-path plugin loads ``hydra.py`` in every app). This file
imports nothing.
"""
