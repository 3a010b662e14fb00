"""Reads for the serving path: deployments and adapters a caller may use, and live replicas."""

from __future__ import annotations

from datetime import datetime

from django.db.models import QuerySet

from core.errors import NotFoundError
from engine.protocol import ReplicaStats
from inference.gateway import replica_stats_list
from inference.models import LoraAdapter, ModelDeployment
from tenants.services import tenant_allowed_models
from tenants.types import AuthContext


def deployment_get_enabled(*, name: str) -> ModelDeployment | None:
    return ModelDeployment.objects.filter(name=name, enabled=True).first()


def deployment_list_enabled() -> list[ModelDeployment]:
    return list(ModelDeployment.objects.filter(enabled=True).order_by("name"))


def deployment_names_enabled(*, names: list[str]) -> list[str]:
    """The enabled deployments among `names`, in their order."""
    enabled = set(ModelDeployment.objects.filter(enabled=True, name__in=names).values_list("name", flat=True))
    return [name for name in names if name in enabled]


def deployment_list_for_caller(*, auth: AuthContext) -> list[ModelDeployment]:
    """Enabled deployments the caller's key may use, in the tenant's order."""
    allowed = tenant_allowed_models(auth=auth)
    by_name = {d.name: d for d in ModelDeployment.objects.filter(enabled=True, name__in=allowed)}
    return [by_name[name] for name in allowed if name in by_name]


def adapter_list_for_tenant(*, tenant_id: int) -> QuerySet[LoraAdapter]:
    return LoraAdapter.objects.filter(tenant_id=tenant_id).select_related("base_model").order_by("name")


def adapter_not_found(name: str) -> NotFoundError:
    return NotFoundError(f"The adapter `{name}` does not exist.", code="adapter_not_found", param="name")


def adapter_get_for_tenant(*, tenant_id: int, name: str) -> LoraAdapter:
    """The tenant's adapter; another tenant's is not found, exactly as a missing one."""
    adapter = adapter_list_for_tenant(tenant_id=tenant_id).filter(name=name).first()
    if adapter is None:
        raise adapter_not_found(name)
    return adapter


def _servable_adapters(*, auth: AuthContext) -> QuerySet[LoraAdapter]:
    # Ready, of the caller's tenant only, on an enabled base the caller's key may use.
    return adapter_list_for_tenant(tenant_id=auth.tenant_id).filter(
        status=LoraAdapter.Status.READY,
        base_model__enabled=True,
        base_model__name__in=tenant_allowed_models(auth=auth),
    )


def adapter_list_unvalidated(*, since_before: datetime) -> list[LoraAdapter]:
    """Adapters still waiting for a validation result, last changed before `since_before`."""
    pending = (LoraAdapter.Status.UPLOADED, LoraAdapter.Status.VALIDATING)
    return list(LoraAdapter.objects.filter(status__in=pending, updated_at__lt=since_before).order_by("pk"))


def adapter_get_servable(*, auth: AuthContext, name: str) -> LoraAdapter | None:
    return _servable_adapters(auth=auth).filter(name=name).first()


def adapter_list_servable(*, auth: AuthContext) -> list[LoraAdapter]:
    """The caller's own ready adapters, listed by /v1/models beside the base models."""
    return list(_servable_adapters(auth=auth))


def deployment_replicas(*, name: str) -> list[ReplicaStats]:
    return replica_stats_list(name)
