"""Selective checkpointing: save the outputs of chosen ops, recompute the rest (``ckpt=selective``).

``policies.py``: ``SelectivePolicy`` and ``make_policy`` (JAX's policies for torch's checkpoint).
``selective_modes.py``: the two dispatch modes of one selectively checkpointed call. ``name_tags.py``:
``checkpoint_name``, the tag a ``policy="names"`` region saves or recomputes by name.

Modules here are imported by name; this file imports none of them.
"""
