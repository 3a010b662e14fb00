"""Typed settings helpers: read the environment, fail loudly on malformed values.

Each helper also accepts `<NAME>_FILE` pointing at a file holding the value (Docker/K8s secrets).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse


class ImproperlyConfiguredEnv(ValueError):
    """A setting in the environment is present but malformed."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    file_path = os.environ.get(f"{name}_FILE")
    if file_path:
        try:
            return Path(file_path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfiguredEnv(f"{name}_FILE={file_path!r} cannot be read: {exc}") from exc
    return os.environ.get(name)


def envstr(name: str, default: str | None = None) -> str | None:
    value = _raw(name)
    return default if value is None else value


def envbool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfiguredEnv(f"{name}={value!r} is not a boolean (use true/false, 1/0, yes/no)")


def envint(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    try:
        parsed = int(value.strip())
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name}={value!r} is not an integer") from None
    if minimum is not None and parsed < minimum:
        raise ImproperlyConfiguredEnv(f"{name}={parsed} is below the minimum {minimum}")
    return parsed


def envfloat(name: str, default: float) -> float:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    try:
        return float(value.strip())
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name}={value!r} is not a number") from None


def envlist(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def envsecret(name: str, default: str) -> str:
    value = _raw(name)
    if value is None:
        return default
    if len(value) < 16:
        raise ImproperlyConfiguredEnv(f"{name} must be at least 16 characters long")
    return value


def database_from_url(url: str) -> dict:
    """Parse postgres://user:pass@host:port/name?opt=v or sqlite:///path into a DATABASES entry."""
    parsed = urlparse(url)
    options = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    if parsed.scheme in {"postgres", "postgresql", "pgsql"}:
        name = unquote(parsed.path.lstrip("/"))
        if not name:
            raise ImproperlyConfiguredEnv(f"DATABASE_URL={url!r} names no database")
        try:
            port = parsed.port
        except ValueError:
            raise ImproperlyConfiguredEnv(f"DATABASE_URL={url!r} has a malformed port") from None
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(port or ""),
            "OPTIONS": options,
            # Under ASGI every request runs its database work in a thread of its own, so a persistent
            # connection is never reused and lingers after its thread: 0 closes it with the request.
            "CONN_MAX_AGE": 0,
            "CONN_HEALTH_CHECKS": True,
        }
    if parsed.scheme == "sqlite":
        path = parsed.path
        if path.startswith("//"):
            path = path[1:]
        else:
            path = path.lstrip("/") or ":memory:"
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": path}
    raise ImproperlyConfiguredEnv(
        f"DATABASE_URL scheme {parsed.scheme!r} is not supported (use postgres:// or sqlite://)"
    )


def redis_url_checked(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in {"redis", "rediss", "unix"}:
        raise ImproperlyConfiguredEnv(f"REDIS_URL={url!r} must start with redis://, rediss:// or unix://")
    return url
