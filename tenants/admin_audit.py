"""The admin's part of the audit log: what an operator's forms, inlines, deletions and actions change.

`AuditedAdmin` makes the signed-in operator the actor of every change an admin view makes (so the
services an action calls record them under that person) and records what the admin saves itself:
the fields of the row before and after, for the object and for each inline row.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db import models

from core.actor import Actor, acting_as
from core.client_address import client_address
from tenants.models import Tenant
from tenants.services import audit_record, audit_snapshot


def admin_actor(request) -> Actor:
    return Actor(
        source="admin",
        user_id=request.user.pk,
        username=request.user.get_username(),
        address=client_address(request),
    )


def _tenant_id(obj: models.Model) -> int | None:
    return obj.pk if isinstance(obj, Tenant) else getattr(obj, "tenant_id", None)


def _stored(obj: models.Model) -> dict[str, Any]:
    """The row as the database has it (the form has already changed `obj`); {} for a new one."""
    if obj.pk is None:
        return {}
    row = type(obj)._default_manager.filter(pk=obj.pk).first()
    return {} if row is None else audit_snapshot(row)


class AuditedAdmin(admin.ModelAdmin):
    # False where a service records the creation itself (it is audited there, once).
    audit_additions = True

    def changeform_view(self, request, *args, **kwargs):
        with acting_as(admin_actor(request)):
            return super().changeform_view(request, *args, **kwargs)

    def changelist_view(self, request, *args, **kwargs):
        with acting_as(admin_actor(request)):  # the actions run from here
            return super().changelist_view(request, *args, **kwargs)

    def delete_view(self, request, *args, **kwargs):
        with acting_as(admin_actor(request)):
            return super().delete_view(request, *args, **kwargs)

    def add_view(self, request, *args, **kwargs):
        with acting_as(admin_actor(request)):
            return super().add_view(request, *args, **kwargs)

    def save_model(self, request, obj, form, change: bool) -> None:
        before = _stored(obj) if change else {}
        super().save_model(request, obj, form, change)
        if change or self.audit_additions:
            audit_record(
                action="update" if change else "create",
                obj=obj,
                tenant_id=_tenant_id(obj),
                before=before,
                after=audit_snapshot(obj),
            )

    def save_formset(self, request, form, formset, change: bool) -> None:
        before = {f.instance.pk: _stored(f.instance) for f in formset.initial_forms if f.instance.pk}
        # Before the deletion, while the rows have their ids (the admin's transaction holds both).
        for deleted in formset.deleted_forms:
            obj = deleted.instance
            if obj.pk is not None:
                audit_record(
                    action="delete", obj=obj, tenant_id=_tenant_id(obj), before=before.get(obj.pk, {})
                )
        super().save_formset(request, form, formset, change)
        for obj in formset.new_objects:
            audit_record(action="create", obj=obj, tenant_id=_tenant_id(obj), after=audit_snapshot(obj))
        for obj, _fields in formset.changed_objects:
            audit_record(
                action="update",
                obj=obj,
                tenant_id=_tenant_id(obj),
                before=before.get(obj.pk, {}),
                after=audit_snapshot(obj),
            )

    def delete_model(self, request, obj) -> None:
        audit_record(action="delete", obj=obj, tenant_id=_tenant_id(obj), before=audit_snapshot(obj))
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset) -> None:
        for obj in queryset.order_by("pk"):
            audit_record(action="delete", obj=obj, tenant_id=_tenant_id(obj), before=audit_snapshot(obj))
        super().delete_queryset(request, queryset)
