"""Liveness, readiness and Prometheus metrics endpoints.

/live (and its older name /health): the process is up. /ready: it can serve new requests: not
draining (core.draining) nor warming up (core.warming), the database and Redis answer, and every
enabled model has a ready engine replica (live and not draining); /ready?scope=web leaves the
engines out. A draining or warming process is live and not ready.

/live and /ready answer anyone (load balancers and orchestrators probe them); anonymously /ready
says only whether this process can serve. The details (which check failed and why, every model
and its replicas) and /metrics (tenant and model names) are for operators: a staff session, or
`Authorization: Bearer <PAGODA_METRICS_TOKEN>`.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from core.draining import is_draining
from core.redis_client import get_redis
from core.warming import is_warming


@require_GET
def live(request):
    return JsonResponse({"status": "ok"})


# A probe answers within seconds: a database that takes longer to accept a connection is down.
DATABASE_PROBE_TIMEOUT_S = 2


def _check_web() -> str | None:
    if is_draining():
        return "draining: this process is shutting down and takes no new connections"
    if is_warming():
        return "warming: this process is loading the models' tokenizers"
    return None


def _check_database() -> str | None:
    try:
        if connection.vendor == "postgresql":
            # A connection of its own, not one from the pool: the pool waits for a free connection
            # (up to its timeout) where a probe must answer at once.
            import psycopg

            params = connection.get_connection_params()
            params.pop("cursor_factory", None)
            params.pop("context", None)
            with psycopg.connect(**params, connect_timeout=DATABASE_PROBE_TIMEOUT_S) as probe:
                probe.execute("SELECT 1").fetchone()
        else:
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
    """Each enabled model with its live replicas; a model none of which is ready (live and not
    draining) is not ready."""
    from dataclasses import asdict

    from inference.gateway.replicas import ready_replica_ids
    from inference.selectors import deployment_list_enabled, deployment_replicas

    models = {}
    for deployment in deployment_list_enabled():
        replicas = [asdict(stats) for stats in deployment_replicas(name=deployment.name)]
        # The one answer admission and routing use (inference.gateway.replicas).
        ready = bool(ready_replica_ids(deployment.name))
        models[deployment.name] = {
            "ready": ready,
            "replicas": replicas,
            "replica_wait_seconds": deployment.replica_wait_seconds,
        }
    return models


def _check_engines(models: dict[str, dict]) -> str | None:
    problems = []
    # A model whose requests wait for a replica to start (scaled to zero) is asleep, not broken.
    missing = sorted(
        name
        for name, model in models.items()
        if not model["ready"] and not model["replicas"] and not model["replica_wait_seconds"]
    )
    if missing:
        problems.append(f"no live engine replica for: {', '.join(missing)}")
    draining = sorted(name for name, model in models.items() if model["replicas"] and not model["ready"])
    if draining:
        problems.append(f"only draining engine replicas for: {', '.join(draining)}")
    return "; ".join(problems) or None


def operator_may_read(request: HttpRequest) -> bool:
    token = settings.METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # As bytes: compare_digest refuses str holding anything but ASCII, and a header may hold any.
    if token and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    try:
        user = request.user  # a session's user: read from the database, which may be what is down
        return bool(user.is_active and user.is_staff)
    except Exception:
        return False


def _operators_only() -> JsonResponse:
    response = JsonResponse(
        {
            "error": {
                "message": "Sign in as staff or send Authorization: Bearer <PAGODA_METRICS_TOKEN>.",
                "type": "invalid_request_error",
                "param": None,
                "code": "operator_only",
            }
        },
        status=401,
    )
    response["WWW-Authenticate"] = 'Bearer realm="operations"'
    return response


# /ready?scope=web: this process alone (draining, database, Redis), for an orchestrator's readiness
# probe of web processes. Every web process sees the same engines: a model without a ready replica
# would take all of them out of the load balancer at once, and with them every other model.
READY_SCOPES = ("all", "web")


@require_GET
def ready(request):
    scope = request.GET.get("scope", "all")
    if scope not in READY_SCOPES:
        return JsonResponse(
            {
                "error": {
                    "message": f"scope must be one of {', '.join(READY_SCOPES)}.",
                    "type": "invalid_request_error",
                    "param": "scope",
                    "code": "invalid_value",
                }
            },
            status=400,
        )
    checks = {
        "web": _check_web(),
        "database": _check_database(),
        "redis": _check_redis(),
    }
    models: dict[str, dict] = {}
    if not checks["database"] and not checks["redis"] and scope == "all":
        try:
            models = _models()
        except Exception as exc:
            checks["models"] = f"models: {exc.__class__.__name__}: {exc}"
        else:
            checks["engines"] = _check_engines(models)
    failures = {name: error for name, error in checks.items() if error}
    body: dict = {"status": "ready" if not failures else "not_ready"}
    if operator_may_read(request):
        body["checks"] = {name: (error or "ok") for name, error in checks.items()}
        body["models"] = models
    return JsonResponse(body, status=200 if not failures else 503)


@require_GET
def metrics(request):
    if not operator_may_read(request):
        return _operators_only()
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)
