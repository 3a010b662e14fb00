from __future__ import annotations

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

        from tenants.redis_client import get_redis
    except Exception:
        return
    client = get_redis()
    for key in client.scan_iter(match=settings.REDIS_PREFIX + "*", count=1000):
        client.delete(key)
