"""ASGI entry point served by daphne: HTTP to Django, websockets to Channels consumers."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from config.embedded_redis import start_if_configured  # noqa: E402

start_if_configured()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from config.routing import websocket_urlpatterns  # noqa: E402


def origin_checked(inner):
    """Browsers always send Origin: theirs must be one of ALLOWED_HOSTS. SDK and server clients send
    none; they are let through, since the websocket authenticates with an API key, never a cookie."""
    browser_checked = AllowedHostsOriginValidator(inner)

    async def app(scope, receive, send):
        headers = dict(scope.get("headers") or ())
        if b"origin" not in headers:
            return await inner(scope, receive, send)
        return await browser_checked(scope, receive, send)

    return app


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": origin_checked(URLRouter(websocket_urlpatterns)),
    }
)
