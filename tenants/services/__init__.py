"""Tenancy services (writes). Other apps import from here, never from the submodules' internals."""

from __future__ import annotations

from tenants.services.admission import (
    admission_reserve,
    admission_settle,
    model_access_check,
    quota_period,
    request_admit,
    tenant_allowed_models,
)
from tenants.services.api_keys import (
    api_key_authenticate,
    api_key_authenticate_header,
    api_key_context,
    api_key_create,
    api_key_digest,
    api_key_revoke,
    api_key_rotate,
    auth_cache_invalidate,
    bearer_token,
)
from tenants.services.audit import audit_changes, audit_purge, audit_record, audit_snapshot
from tenants.services.settlements import (
    settlement_close,
    settlement_list_open,
    settlement_mark_abandoned,
    settlement_record,
)
from tenants.services.tenants import (
    api_key_create_for_member,
    api_key_revoke_for_member,
    api_key_rotate_for_member,
    membership_can_manage,
    membership_create,
    membership_require_manager,
    tenant_create,
    tenant_limits_update,
    tenant_set_active,
)
from tenants.services.usage import usage_record_create, usage_rollup

__all__ = [
    "admission_reserve",
    "admission_settle",
    "api_key_authenticate",
    "audit_changes",
    "audit_purge",
    "audit_record",
    "audit_snapshot",
    "api_key_authenticate_header",
    "api_key_context",
    "api_key_create",
    "api_key_create_for_member",
    "api_key_digest",
    "api_key_revoke",
    "api_key_revoke_for_member",
    "api_key_rotate",
    "api_key_rotate_for_member",
    "auth_cache_invalidate",
    "bearer_token",
    "membership_can_manage",
    "membership_create",
    "membership_require_manager",
    "model_access_check",
    "quota_period",
    "request_admit",
    "settlement_close",
    "settlement_list_open",
    "settlement_mark_abandoned",
    "settlement_record",
    "tenant_allowed_models",
    "tenant_create",
    "tenant_limits_update",
    "tenant_set_active",
    "usage_record_create",
    "usage_rollup",
]
