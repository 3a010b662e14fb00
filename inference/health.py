"""Liveness, readiness and Prometheus metrics endpoints."""

from __future__ import annotations

from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from core.redis_client import get_redis


@require_GET
def health(request):
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any driver error means not ready
        return f"database: {exc.__class__.__name__}: {exc}"
    return None


def _check_redis() -> str | None:
    try:
        get_redis().ping()
    except Exception as exc:
        return f"redis: {exc.__class__.__name__}: {exc}"
    return None


def _models() -> dict[str, dict]:
    """Each enabled model with its live replicas; a model with none is not ready."""
    from dataclasses import asdict

    from inference.selectors import deployment_list_enabled, deployment_replicas

    models = {}
    for deployment in deployment_list_enabled():
        replicas = [asdict(stats) for stats in deployment_replicas(name=deployment.name)]
        models[deployment.name] = {"ready": bool(replicas), "replicas": replicas}
    return models


@require_GET
def ready(request):
    checks = {"database": _check_database(), "redis": _check_redis()}
    models: dict[str, dict] = {}
    if not any(checks.values()):
        try:
            models = _models()
        except Exception as exc:
            checks["models"] = f"models: {exc.__class__.__name__}: {exc}"
        else:
            missing = sorted(name for name, model in models.items() if not model["ready"])
            checks["engines"] = f"no live engine replica for: {', '.join(missing)}" if missing else None
    failures = {name: error for name, error in checks.items() if error}
    body = {
        "status": "ready" if not failures else "not_ready",
        "checks": {name: (error or "ok") for name, error in checks.items()},
        "models": models,
    }
    return JsonResponse(body, status=200 if not failures else 503)


@require_GET
def metrics(request):
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)
