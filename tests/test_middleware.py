"""The middleware chain under ASGI: API requests stay on the event loop; static files still served."""

from __future__ import annotations

import pytest
from asgiref.sync import AsyncToSync
from django.test import AsyncClient

pytestmark = pytest.mark.django_db(transaction=True)


async def test_an_api_request_crosses_no_sync_middleware(world, monkeypatch) -> None:
    # given a spy on asgiref's sync-to-async bridge back to the event loop, which Django puts below
    # any sync-only middleware of an async chain
    calls: list[object] = []
    original = AsyncToSync.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.awaitable)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AsyncToSync, "__call__", counted)
    # when a tenant lists its models over ASGI
    response = await AsyncClient().get("/v1/models", headers=world.headers())
    # then the answer came without the request hopping to a worker thread and back
    assert response.status_code == 200, response.content
    assert calls == []


async def test_static_files_are_served_under_asgi() -> None:
    response = await AsyncClient().get("/static/dashboard/dashboard.css")
    assert response.status_code == 200
    body = b"".join(response.streaming_content)
    assert b"{" in body and response["Content-Type"].startswith("text/css")


async def test_a_missing_static_file_is_a_404_and_api_paths_stay_json() -> None:
    assert (await AsyncClient().get("/static/dashboard/nope.css")).status_code == 404
    response = await AsyncClient().get("/v1/nope")
    assert response.status_code == 404 and response["Content-Type"].startswith("application/json")
