"""Segments: consecutive layers checkpointed as one region (``ckpt.segments``, ``checkpoint_sequential``).

``sequential.py``: schedules over a chain (fixed, square root, recursive, or planned regions) and
``checkpoint_sequential`` for a list of modules or functions. ``chain.py``: those regions over a model's
own chain of layers, opened and closed by hooks, without editing the parent's ``forward``.
``chain_check.py``: whether the layers form a chain, where they sit and where they run.

Modules here are imported by name; this file imports none of them.
"""
