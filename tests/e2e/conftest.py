"""Fixtures of the end-to-end tests: a tiny model built once, rows committed where the server
processes can read them, and the serving stack's logs attached to every failing test's report."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def e2e_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("e2e-tiny-llama"), arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="module")
def committed_db(django_db_setup, django_db_blocker) -> Iterator[Callable[[], AbstractContextManager]]:
    """`with committed_db(): ...` writes to the test database in autocommit, so daphne and the
    engines (other processes) see the rows at once. The module's rows are removed after its last
    test, as a transactional test case would, so later tests start from an empty database; and so
    is what the module left in Redis (rate-limit logs, quota counters, streams), since `flush`
    restarts the ids those keys are named by."""
    from django.conf import settings
    from django.core.management import call_command

    from core.redis_client import get_redis

    yield django_db_blocker.unblock
    with django_db_blocker.unblock():
        call_command("flush", interactive=False, verbosity=0)
    client = get_redis()
    for key in client.scan_iter(match=settings.REDIS_PREFIX + "*", count=1000):
        client.delete(key)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from tests.e2e.stack import ServingStack

    for value in getattr(item, "funcargs", {}).values():
        stack = value if isinstance(value, ServingStack) else getattr(value, "stack", None)
        if isinstance(stack, ServingStack):
            report.sections.append((f"serving stack logs ({stack.model})", stack.log_tails()))
