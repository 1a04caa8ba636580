"""Checkpointing a recurrence (``checkpoint_scan``).

``scan.py``: ``checkpoint_scan``, a carry kept every ``save_every_n`` steps or, with ``snapshots=k``
and ``outputs="last"``, Griewank's binomial schedule. ``revolve.py``: that schedule as plain actions,
no tensors. ``scan_reversal.py``: the schedule run on tensors, one autograd node reversing the scan.

Modules here are imported by name; this file imports none of them.
"""
