"""``ckpt=auto``'s planner, on top of the engine and measure: profile the candidate layers
(``profile.py``), choose options under a budget (``planner.py``, ``budget.py``) and return a
:class:`~ckpt_plugin.engine.plan.WrapPlan`. It never installs. Torch only."""
