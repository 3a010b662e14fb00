from __future__ import annotations

from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The tasks, registered in every process: services queue them by name.
        import inference.tasks  # noqa: F401
        from inference.metrics import register_engine_collector

        register_engine_collector()
