"""The address of the client a request came from, as the platform's own proxy reports it.

Behind the TLS proxy (BEHIND_TLS_PROXY) every connection comes from the proxy, so its address says
nothing about the client: the proxy appends the address of its peer to X-Forwarded-For. Entries to
the left of the ones the platform's proxies appended were written by the client and are not
believed; with PROXY_COUNT proxies in front, the client's address is the PROXY_COUNT-th from the
right. Without a proxy, or when the header is missing or malformed, it is the peer's address.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def client_address(request: HttpRequest) -> str | None:
    peer = request.META.get("REMOTE_ADDR")
    count = settings.PROXY_COUNT if settings.BEHIND_TLS_PROXY else 0
    if count < 1:
        return peer
    entries = [e.strip() for e in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    if len(entries) < count or not entries[-count]:
        return peer
    address = entries[-count]
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return peer
