"""API-key authentication for the async views and the websocket consumer."""

from __future__ import annotations

from asgiref.sync import sync_to_async

from tenants.services import api_key_authenticate, bearer_token
from tenants.types import AuthContext


async def authenticate_header(authorization: str | None) -> AuthContext:
    raw_key = bearer_token(authorization=authorization)
    return await sync_to_async(api_key_authenticate)(raw_key=raw_key)


async def authenticate_key(raw_key: str) -> AuthContext:
    return await sync_to_async(api_key_authenticate)(raw_key=raw_key)
