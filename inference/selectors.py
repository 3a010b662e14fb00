"""Reads for the serving path: deployments a caller may use, and their live replicas."""

from __future__ import annotations

from engine.protocol import ReplicaStats
from inference.gateway import replica_stats_list
from inference.models import ModelDeployment
from tenants.services import tenant_allowed_models
from tenants.types import AuthContext


def deployment_get_enabled(*, name: str) -> ModelDeployment | None:
    return ModelDeployment.objects.filter(name=name, enabled=True).first()


def deployment_list_enabled() -> list[ModelDeployment]:
    return list(ModelDeployment.objects.filter(enabled=True).order_by("name"))


def deployment_list_for_caller(*, auth: AuthContext) -> list[ModelDeployment]:
    """Enabled deployments the caller's key may use, in the tenant's order."""
    allowed = tenant_allowed_models(auth=auth)
    by_name = {d.name: d for d in ModelDeployment.objects.filter(enabled=True, name__in=allowed)}
    return [by_name[name] for name in allowed if name in by_name]


def adapter_names_for_caller(*, auth: AuthContext) -> list[str]:
    """The caller's own ready LoRA adapters, listed by /v1/models beside the base models.

    Adapters are not served yet: this is the one place that will list them (the caller's tenant
    only, never another tenant's)."""
    return []


def deployment_replicas(*, name: str) -> list[ReplicaStats]:
    return replica_stats_list(name)
