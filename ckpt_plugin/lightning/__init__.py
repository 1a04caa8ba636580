"""The Lightning layer, the top of the library: the callback (``callback.py``), what each
strategy needs checked or set up (``strategies.py``), and exact resume (``resume.py``)."""
