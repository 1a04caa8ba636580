"""``ckpt=auto``'s planner, on top of the engine and measure: profile the candidate layers
(``profile.py``), choose options under a budget (``planner.py``, ``budget.py``) and return a
:class:`~ckpt_plugin.engine.plan.WrapPlan`; for ``ckpt.segments=optimal``, the optimal nesting of
regions over a chain (``rotor.py``). It never installs. Torch only."""
