"""The spine, above config, engine, measure and planning: a validated ``ckpt`` config becomes one plan
(``plan.py``; ``auto.py`` for ``ckpt=auto``, ``segments.py`` for regions over a chain, ``treatment.py`` for how a
wrapped call runs, ``diagnose.py`` for why a budget is refused) and the engine installs it (``install.py``).
Nothing below calls back up into it. Modules here are imported by name; this file imports none of them.
"""
