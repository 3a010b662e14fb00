"""The tenants' variation of the fixture world (tests/conftest.py): A may also use another model,
and B may use the world's model too, so only tenancy keeps B from A's keys and usage."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tests.helpers import MODEL


@pytest.fixture
def world_options() -> dict:
    return {"tenant_a": {"allowed_models": [MODEL, "other-model"]}, "tenant_b": {"allowed_models": [MODEL]}}


@pytest.fixture
def api_client() -> APIClient:
    return APIClient()


from tests.inference.peft_adapters import celery_eager  # noqa: E402, F401 - fixture
