from __future__ import annotations

import os
import threading

from celery import Celery
from celery.signals import beat_init, worker_init, worker_ready

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


# The queue the batch runners take (settings.CELERY_TASK_ROUTES).
BATCHES_QUEUE = "batches"


@worker_ready.connect
def _warm_batch_runner(sender=None, **_kwargs) -> None:
    # A worker that runs batches loads the models' tokenizers beside its first tasks (a task that
    # needs one meanwhile waits for the same load), not on its first batch's lines.
    queues = sender.app.amqp.queues.consume_from if sender is not None else {}
    if BATCHES_QUEUE in (queues or {}):
        from batches.runner import runner_warm

        threading.Thread(target=runner_warm, name="batch-runner-warm", daemon=True).start()
