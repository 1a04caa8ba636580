"""Example models and data used by recipes/train.py, the tests and the benchmarks."""
