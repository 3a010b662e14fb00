"""The serving world of tests/inference (two tenants, a tiny served model, a real engine worker)."""

from tests.inference.conftest import (  # noqa: F401 - fixtures
    _close_executor_connections,
    engine_worker,
    served_model_dir,
    world,
)
