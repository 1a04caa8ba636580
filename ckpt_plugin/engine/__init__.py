"""The engine: torch only. How a module gets wrapped (``wrap.py``), how a wrapped call runs
(``treatment.py``), what to wrap (``selection.py``), segments over a chain (``chain.py``,
``sequential.py``), selective policies, offload, the BatchNorm fix, the recompute check,
``checkpoint``/``checkpoint_scan`` for plain functions, DeepSpeed's checkpoint on request.

It imports nothing from Lightning, Hydra, or the layers above it (``measure``,
``planning``, ``config``, ``lightning``). Modules here are imported by name; this
file imports none of them.
"""
