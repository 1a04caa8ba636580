"""A run's lifecycle under Lightning, apart from checkpointing activations: ``preemption.py`` (a signal
sets a flag, all ranks save at the next step boundary, then requeue), ``atomic.py`` (checkpoint saves
that are complete or absent), ``resume.py`` (every rank's RNG saved and restored, the newest complete
checkpoint), ``slurm.py`` (what SLURM tells a job).

It imports Lightning but no other layer of the package; the callback does not use it. Modules here are
imported by name; this file imports none of them.
"""
