"""The ``ckpt`` config: its typed schema (``schema.py``, ``deepspeed.py``; no framework at
import time) and the one function that turns a validated config into a plan and installs it
(``plan.py``). Above the engine, measure and planning; below the Lightning layer."""
