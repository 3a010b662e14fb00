from __future__ import annotations

from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The tasks, registered in every process: services queue them by name.
        import tenants.tasks  # noqa: F401
