"""Register model directories as deployments the platform serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from core.errors import InvalidRequestError
from engine.rules import model_context_length, model_task
from inference.models import ModelDeployment
from tenants.services import audit_record, audit_snapshot


class ModelDirectoryError(InvalidRequestError):
    code = "invalid_model_directory"
    default_message = "The model directory is not a Hugging Face model directory."


def model_context_limit(*, model_path: Path) -> int:
    """The longest context the engine will accept for this checkpoint, read from its config.json
    (which must be of an architecture the engine serves: `model_facts`)."""
    return model_facts(model_path=model_path)[0]


def model_facts(*, model_path: Path, task: str | None = None) -> tuple[int, str]:
    """(the longest context the engine will accept, the task: generate or embed) of a checkpoint,
    read from its config.json by the engine's own rules (engine.rules), so a deployment registered
    here never asks the engine for more than it serves. `task` is the operator's (a decoder may
    embed; an encoder cannot generate); None: the checkpoint's default.
    """
    if not model_path.is_dir():
        raise ModelDirectoryError(f"model directory {str(model_path)!r} does not exist")
    config_path = model_path / "config.json"
    if not config_path.is_file():
        raise ModelDirectoryError(
            f"{model_path} has no config.json: point at a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelDirectoryError(f"{config_path} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelDirectoryError(f"{config_path} must hold a JSON object")
    try:
        default_task = model_task(raw)  # an engine could not load anything else
        limit = model_context_length(raw)
    except ValueError as exc:
        raise ModelDirectoryError(f"{config_path}: {exc}") from exc
    if task is None:
        return limit, default_task
    try:
        return limit, model_task(raw, task)
    except ValueError as exc:
        raise InvalidRequestError(f"{model_path}: {exc}", param="task") from exc


@transaction.atomic
def deployment_register(
    *,
    name: str,
    model_path: str | Path,
    max_model_len: int | None = None,
    dtype: str = ModelDeployment.Dtype.AUTO,
    engine_settings: dict[str, Any] | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    task: str | None = None,
    replica_wait_seconds: int | None = None,
) -> tuple[ModelDeployment, bool]:
    """Create the deployment `name`, or update it in place; returns (deployment, created).

    Running it twice with the same arguments leaves one unchanged row. max_model_len defaults to the
    checkpoint's context limit and is capped by it. Given engine settings are merged over the stored
    ones (a value of None removes the key), so options set in the admin survive a re-registration.
    The enabled flag is left as the operator set it; a new deployment starts enabled. The parsers,
    when given ("" for none), replace the stored ones; when not, they stay (a new deployment takes
    the defaults). So does the task (generate or embed): when not given, the stored one stays where
    the checkpoint allows it; a new deployment takes the checkpoint's default. The replica wait,
    when given, replaces the stored one (a new deployment: 0).
    """
    path = Path(model_path).expanduser().resolve()
    limit, default_task = model_facts(model_path=path)
    if max_model_len is not None and max_model_len < 1:
        raise InvalidRequestError(f"max_model_len must be >= 1, got {max_model_len}", param="max_model_len")
    if dtype not in ModelDeployment.Dtype.values:
        raise InvalidRequestError(
            f"dtype must be one of {', '.join(ModelDeployment.Dtype.values)}, got {dtype!r}", param="dtype"
        )
    length = limit if max_model_len is None else min(max_model_len, limit)
    deployment = ModelDeployment.objects.select_for_update().filter(name=name).first()
    created = deployment is None
    if task is not None:
        task = model_facts(model_path=path, task=task)[1]
    elif deployment is not None and deployment.task != default_task:
        try:
            task = model_facts(model_path=path, task=deployment.task)[1]
        except InvalidRequestError:  # the path now holds a model that cannot do it
            task = default_task
    else:
        task = default_task
    if deployment is None:
        deployment = ModelDeployment(name=name, enabled=True, engine_settings={})
    before = {} if created else audit_snapshot(deployment)
    settings = dict(deployment.engine_settings or {})
    for key, value in (engine_settings or {}).items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    deployment.model_path = str(path)
    deployment.max_model_len = length
    deployment.dtype = dtype
    deployment.task = task
    deployment.engine_settings = settings
    if tool_call_parser is not None:
        deployment.tool_call_parser = tool_call_parser
    if reasoning_parser is not None:
        deployment.reasoning_parser = reasoning_parser
    if replica_wait_seconds is not None:
        if replica_wait_seconds < 0:
            raise InvalidRequestError(
                f"replica_wait_seconds must be >= 0, got {replica_wait_seconds}", param="replica_wait_seconds"
            )
        deployment.replica_wait_seconds = replica_wait_seconds
    try:
        deployment.full_clean()
    except ValidationError as exc:
        details = "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in exc.message_dict.items())
        raise InvalidRequestError(f"model deployment {name!r} is invalid ({details})") from exc
    deployment.save()
    audit_record(
        action="create" if created else "update",
        obj=deployment,
        tenant_id=None,
        before=before,
        after=audit_snapshot(deployment),
    )
    return deployment, created
