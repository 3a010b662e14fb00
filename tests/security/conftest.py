"""The serving variation of the fixture world, as tests/inference has it (a tiny served model, a
real engine worker)."""

from tests.inference.conftest import (  # noqa: F401 - fixtures
    _close_executor_connections,
    engine_worker,
    served_model_dir,
    world_options,
)
from tests.inference.peft_adapters import adapters_dir, celery_eager, media_root  # noqa: F401, E402 - fixtures
