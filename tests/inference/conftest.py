"""The serving path's fixture world: tenants A and B with keys, a deployment of a tiny model,
and a scripted engine replica on the real Redis."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from inference.models import ModelDeployment
from tenants.models import ApiKey, Tenant
from tests.inference.fakes import FakeEngine
from tests.inference.peft_adapters import (  # noqa: F401 - fixtures of the adapter tests
    adapters_dir,
    celery_eager,
    media_root,
    world_in_transaction,
)

MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("served-tiny"), arch="llama", size="tiny", seed=0)


@dataclass
class ServingWorld:
    model: str
    deployment: ModelDeployment
    tenant_a: Tenant
    tenant_b: Tenant
    key_a: ApiKey
    raw_key_a: str
    raw_key_b: str
    engine: FakeEngine

    def headers(self, raw_key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {raw_key or self.raw_key_a}"}


def make_world(*, model_dir: Path, slug_suffix: str = "", **limits_a) -> ServingWorld:
    from tenants.services import api_key_create, tenant_create

    # A fresh served name per test: heartbeats and request streams of tests never mix.
    model = f"tiny-{uuid.uuid4().hex[:8]}"
    deployment = ModelDeployment.objects.create(name=model, model_path=str(model_dir), max_model_len=MAX_MODEL_LEN)
    tenant_a = tenant_create(name="Tenant A", slug=f"tenant-a{slug_suffix}", allowed_models=[model], **limits_a)
    # B may not use the model: it is "another tenant's" model from A's point of view and vice versa.
    tenant_b = tenant_create(name="Tenant B", slug=f"tenant-b{slug_suffix}", allowed_models=["b-only-model"])
    key_a, raw_key_a = api_key_create(tenant=tenant_a, name="a-key")
    _, raw_key_b = api_key_create(tenant=tenant_b, name="b-key")
    return ServingWorld(model, deployment, tenant_a, tenant_b, key_a, raw_key_a, raw_key_b, FakeEngine(model))


@pytest.fixture
def world(transactional_db, served_model_dir) -> ServingWorld:
    return make_world(model_dir=served_model_dir)


@pytest.fixture(autouse=True)
async def _close_executor_connections():
    """Views reach the database from asgiref's executor thread; close that thread's connection so
    the test database can be dropped at the end."""
    yield
    from asgiref.sync import sync_to_async
    from django.db import connections

    await sync_to_async(connections.close_all)()
