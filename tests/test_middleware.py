"""The middleware chain under ASGI: API requests stay on the event loop; static files still served."""

from __future__ import annotations

import pytest
from asgiref.sync import AsyncToSync, SyncToAsync
from django.test import AsyncClient

pytestmark = pytest.mark.django_db(transaction=True)


async def test_an_api_request_makes_no_thread_hop_through_the_middleware(world, monkeypatch) -> None:
    # given spies on asgiref's bridges: back to the event loop (below any sync-only middleware of an
    # async chain) and to the request's own thread (each hook of Django's MiddlewareMixin under ASGI)
    back_to_loop: list[object] = []
    to_request_thread: list[object] = []
    to_loop, to_thread = AsyncToSync.__call__, SyncToAsync.__call__

    def counted_to_loop(self, *args, **kwargs):
        back_to_loop.append(self.awaitable)
        return to_loop(self, *args, **kwargs)

    def counted_to_thread(self, *args, **kwargs):
        if self._thread_sensitive and getattr(self.func, "__name__", "").startswith("process_"):
            to_request_thread.append(self.func)  # a middleware hook (not Django's request signals)
        return to_thread(self, *args, **kwargs)

    monkeypatch.setattr(AsyncToSync, "__call__", counted_to_loop)
    monkeypatch.setattr(SyncToAsync, "__call__", counted_to_thread)
    # when a tenant lists its models over ASGI
    response = await AsyncClient().get("/v1/models", headers=world.headers())
    # then the answer came without a middleware hook hopping to the request's thread or back
    assert response.status_code == 200, response.content
    assert back_to_loop == [] and to_request_thread == []
    # while a page still runs the browser middleware as Django does (a session, framing denied)
    page = await AsyncClient().get("/dashboard/login/")
    assert page.status_code == 200 and page["X-Frame-Options"] == "DENY"
    assert "Content-Security-Policy" in page and to_request_thread


async def test_api_answers_keep_the_security_headers() -> None:
    response = await AsyncClient().get("/v1/models")
    assert response.status_code == 401
    assert response["X-Content-Type-Options"] == "nosniff"


async def test_static_files_are_served_under_asgi() -> None:
    response = await AsyncClient().get("/static/dashboard/dashboard.css")
    assert response.status_code == 200
    body = b"".join(response.streaming_content)
    assert b"{" in body and response["Content-Type"].startswith("text/css")


async def test_a_missing_static_file_is_a_404_and_api_paths_stay_json() -> None:
    assert (await AsyncClient().get("/static/dashboard/nope.css")).status_code == 404
    response = await AsyncClient().get("/v1/nope")
    assert response.status_code == 404 and response["Content-Type"].startswith("application/json")
