"""Measuring, on top of the engine: saved bytes, peaks by category and FLOPs (``memory.py``),
the callback's table (``report.py``), ``saved_activations`` (``residuals.py``), and running
a model on its sample input (``sample.py``). Torch only."""
