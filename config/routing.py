from __future__ import annotations

from django.urls import path

from inference.consumers import ChatConsumer

websocket_urlpatterns: list = [
    path("ws/v1/chat", ChatConsumer.as_asgi()),
]
