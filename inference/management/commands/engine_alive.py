"""Exit 0 when the model has at least one live engine replica (a fresh heartbeat): the engine
container's health check. Live and ready are those of inference.gateway.replicas, which admission,
routing and /ready use: a draining replica is live (it finishes its requests) but not ready."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from inference.gateway.replicas import live_replica_ids, ready_replica_ids


class Command(BaseCommand):
    help = "Check that a model has a live engine replica (fresh heartbeat)."

    def add_arguments(self, parser):
        parser.add_argument("--model", required=True)

    def handle(self, *args, model: str, **options):
        live = live_replica_ids(model)
        if not live:
            raise CommandError(f"no live engine replica for model {model!r}")
        ready = ready_replica_ids(model)
        self.stdout.write(f"{len(live)} live replica(s) for {model}, {len(ready)} ready (not draining)")
