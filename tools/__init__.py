"""Tools beside the engine: the checkpoint writers of tests and bench.py (checkpoint.py), the demo trainer."""
