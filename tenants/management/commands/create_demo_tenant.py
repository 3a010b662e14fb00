"""Create (or reuse) a demo tenant, an owner who can log in, and a fresh API key; print them."""

from __future__ import annotations

import json

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from tenants.models import Membership, Tenant, TenantLimits
from tenants.services import api_key_create, membership_create, tenant_create, tenant_limits_update


class Command(BaseCommand):
    help = "Create a demo tenant, user and API key, and print them (the key is shown only here)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--slug", default="demo")
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="demo-password")
        parser.add_argument("--email", default="demo@example.com")
        parser.add_argument("--models", default="", help="comma-separated served model names it may use")
        parser.add_argument("--superuser", action="store_true", help="also make the user a superuser")
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    @transaction.atomic
    def handle(self, *args, **opts) -> None:
        models = [m.strip() for m in opts["models"].split(",") if m.strip()]
        tenant = Tenant.objects.filter(slug=opts["slug"]).first()
        if tenant is None:
            tenant = tenant_create(name=opts["slug"].title(), slug=opts["slug"], allowed_models=models)
        elif models:
            tenant_limits_update(tenant=tenant, allowed_models=models)
        user_model = get_user_model()
        user = user_model.objects.filter(username=opts["username"]).first()
        if user is None:
            user = user_model.objects.create_user(
                username=opts["username"], email=opts["email"], password=opts["password"]
            )
        else:
            # Re-running prints working credentials.
            user.set_password(opts["password"])
            user.save(update_fields=["password"])
        if opts["superuser"]:
            user.is_staff = user.is_superuser = True
            user.save(update_fields=["is_staff", "is_superuser"])
        membership_create(tenant=tenant, user=user, role=Membership.Role.OWNER)
        api_key, raw_key = api_key_create(tenant=tenant, name="demo key", created_by=user)
        result = {
            "tenant": tenant.slug,
            "username": user.get_username(),
            "password": opts["password"],
            "api_key": raw_key,
            "api_key_prefix": api_key.display_prefix,
            "models": list(TenantLimits.objects.get(tenant=tenant).allowed_models),
        }
        if opts["json"]:
            self.stdout.write(json.dumps(result))
            return
        for name, value in result.items():
            self.stdout.write(f"{name}: {value}")
