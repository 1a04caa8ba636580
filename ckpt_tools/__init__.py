"""Tools that use the library and are never used by it: ``ckpt-inspect`` (``inspection.py``),
``ckpt-bench`` (``bench.py``) and ``ckpt-soak`` (``soak.py``).

Importing the package lets torchvision import where its compiled ops do not load (``torchvision_cpu.py``:
the registry's CUDA torchvision on the CPU torch, which the test environment has for timm).
"""

from ckpt_tools import torchvision_cpu

torchvision_cpu.install()
