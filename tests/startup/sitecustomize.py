"""Run by every interpreter the test suite starts (``tests/conftest.py`` puts this folder first on PYTHONPATH).

The test environment has timm's torchvision, a CUDA build whose compiled ops do not load on the CPU torch;
unguarded, its import fails, and with it ``import lightning.pytorch`` (torchmetrics imports torchvision
whenever it is installed). Importing ``ckpt_tools`` installs the guard (``ckpt_tools/torchvision_cpu.py``)
before anything imports torchvision: a recipe run, a DDP worker, a script under ``python -c``. It imports
nothing heavy: torch only once torchvision is imported. Nothing outside the test run sees this folder.
"""

try:
    import ckpt_tools  # noqa: F401
except ImportError:  # an interpreter without the project: nothing here to guard
    pass
