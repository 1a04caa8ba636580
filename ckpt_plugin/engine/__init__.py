"""The engine: torch only. How a module gets wrapped (``wrap.py``), how a wrapped call runs
(``treatment.py``), the plan it installs (``plan.py``), the one writer of ``forward``
(``forwards.py``); what to wrap (``selection.py``, ``blocks.py``); offload, the BatchNorm fix,
side effects, the recompute check, regional compile, op groups, ``checkpoint`` for plain
functions, DeepSpeed's checkpoint on request. Three families have folders: ``segments/`` (chains
and ``checkpoint_sequential``), ``scan/`` (``checkpoint_scan`` and revolve), ``selective/``
(policies and ``checkpoint_name``).

It imports nothing from Lightning, Hydra, or the layers above it (``measure``,
``planning``, ``apply``, ``runs``, ``lightning``). Modules here are imported by name; this
file imports none of them.
"""
