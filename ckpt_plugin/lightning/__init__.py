"""The Lightning layer, the top of the library: the callback (``callback.py``), ``ckpt=auto``'s sample
(``sample.py``), what each strategy needs checked or set up (``strategies.py``), and a Hydra app's
helpers (``app.py``). A run's lifecycle (preemption, atomic saves, resume, SLURM) is ``runs/``."""
