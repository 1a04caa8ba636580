"""Tools that use the library and are never used by it: ``ckpt-inspect`` (``inspection.py``),
``ckpt-bench`` (``bench.py``) and ``ckpt-soak`` (``soak.py``)."""
