"""Tests of `core/`, one module per module (`core/api/base.py` -> `tests/core/api/test_base.py`)."""
