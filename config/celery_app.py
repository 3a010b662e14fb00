from __future__ import annotations

import os

from celery import Celery
from celery.signals import beat_init, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("pagoda")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
@beat_init.connect
def _start_embedded_redis(**_kwargs) -> None:
    # The broker connection is made after these signals; the web process starts the server too.
    from config.embedded_redis import start_if_configured

    start_if_configured()
