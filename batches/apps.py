from __future__ import annotations

from django.apps import AppConfig


class BatchesConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "batches"
    verbose_name = "Batches"
