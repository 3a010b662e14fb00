"""Register a model directory as a deployment: `python manage.py model_register --name NAME --path DIR`.

Idempotent: an existing deployment of that name is updated in place (scripts/up.sh runs it on every
start). max_model_len defaults to the checkpoint's max_position_embeddings.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from core.errors import PlatformError
from engine.rules import engine_settings_errors
from inference.models import ModelDeployment
from inference.reasoning import PARSERS as REASONING_PARSERS
from inference.services import deployment_register
from inference.tool_parsers import PARSERS as TOOL_PARSERS


def engine_setting(text: str) -> tuple[str, Any]:
    """`key=value`; the value is read as JSON when it is JSON (64, 0.5, true, null), else as text."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key or not raw.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw.strip()
    errors = engine_settings_errors({key: value})
    if errors:
        raise argparse.ArgumentTypeError("; ".join(errors))
    return key, value


class Command(BaseCommand):
    help = "Create or update a model deployment from a Hugging Face model directory."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--name", required=True, help="served name: what clients put in `model`")
        parser.add_argument(
            "--path", required=True, help="model directory (config.json, *.safetensors, tokenizer)"
        )
        parser.add_argument(
            "--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings"
        )
        parser.add_argument(
            "--dtype", choices=ModelDeployment.Dtype.values, default=ModelDeployment.Dtype.AUTO
        )
        parser.add_argument(
            "--engine-setting",
            dest="engine_settings",
            type=engine_setting,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="an engine option, repeatable (e.g. max_num_seqs=64); KEY=null removes a stored one",
        )
        parser.add_argument(
            "--task",
            choices=ModelDeployment.Task.values,
            default=None,
            help="embed: an embedding model built on a decoder (an encoder always embeds); default: as"
            " stored, or the checkpoint's own (generate for a decoder)",
        )
        # Left as stored (or the default, for a new deployment) when not given; "none" turns off.
        parser.add_argument(
            "--tool-call-parser",
            choices=[*TOOL_PARSERS, "none"],
            default=None,
            help="how tool calls are read from the output when tool_choice is auto",
        )
        parser.add_argument(
            "--reasoning-parser",
            choices=[*REASONING_PARSERS, "none"],
            default=None,
            help="how a reasoning model's thinking is read apart from its answer (reasoning_content)",
        )
        parser.add_argument(
            "--replica-wait-seconds",
            type=int,
            default=None,
            help="with no ready replica, how long a request waits, queued, for one to start (a model an "
            "autoscaler scales to zero); 0: a 503 at once (the default for a new deployment)",
        )

    def handle(self, *args, name: str, path: str, max_model_len: int | None, dtype: str, **options) -> None:
        try:
            deployment, created = deployment_register(
                name=name,
                model_path=path,
                max_model_len=max_model_len,
                dtype=dtype,
                engine_settings=dict(options["engine_settings"]),
                tool_call_parser=_parser_choice(options["tool_call_parser"]),
                reasoning_parser=_parser_choice(options["reasoning_parser"]),
                task=options["task"],
                replica_wait_seconds=options["replica_wait_seconds"],
            )
        except PlatformError as exc:
            raise CommandError(exc.message) from exc
        verb = "created" if created else "updated"
        parsers = (
            f"tool call parser {deployment.tool_call_parser or 'none'}, "
            f"reasoning parser {deployment.reasoning_parser or 'none'}, "
            if deployment.task == deployment.Task.GENERATE
            else ""
        )
        self.stdout.write(
            f"model {deployment.name} {verb}: {deployment.model_path} "
            f"(task {deployment.task}, max_model_len {deployment.max_model_len}, dtype {deployment.dtype}, "
            f"{parsers}engine settings {json.dumps(deployment.engine_settings, sort_keys=True)}, "
            f"replica wait {deployment.replica_wait_seconds} s)"
        )


def _parser_choice(value: str | None) -> str | None:
    return "" if value == "none" else value
