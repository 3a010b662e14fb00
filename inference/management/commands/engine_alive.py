"""Exit 0 when the model has at least one engine replica with a fresh heartbeat (container health check)."""

from __future__ import annotations

import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.redis_client import get_redis
from engine.protocol import replicas_key


class Command(BaseCommand):
    help = "Check that a model has a live engine replica (fresh heartbeat)."

    def add_arguments(self, parser):
        parser.add_argument("--model", required=True)

    def handle(self, *args, model: str, **options):
        cutoff = time.time() - settings.ENGINE_HEARTBEAT_TTL
        live = get_redis().zrangebyscore(replicas_key(settings.REDIS_PREFIX, model), cutoff, "+inf")
        if not live:
            raise CommandError(f"no live engine replica for model {model!r}")
        self.stdout.write(f"{len(live)} live replica(s) for {model}")
