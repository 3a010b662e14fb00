"""Tenant LoRA adapters: upload (store, then validate in Celery), re-upload, delete.

Files live under MEDIA_ROOT/adapters/<tenant>/<name>/<version>/. An upload is written to a
staging directory beside the versions and renamed into place only once every check passed, and
the row is switched to the new version in one transaction: a reader sees the old version or the
new one, never a half-written directory. A refused upload leaves nothing on disk or in the database.
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Collection, Sequence
from datetime import timedelta
from pathlib import Path

from celery import signature
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Sum
from django.utils import timezone

from core.errors import InvalidRequestError
from inference.models import ADAPTER_NAME_VALIDATOR, LoraAdapter, ModelDeployment
from inference.selectors import adapter_list_unvalidated, adapter_not_found
from inference.services.adapter_checks import AdapterInvalid, adapter_check
from inference.services.adapter_files import Upload, stage_upload
from tenants.models import Tenant
from tenants.services import audit_record, audit_snapshot, membership_require_manager

logger = logging.getLogger(__name__)
VALIDATE_TASK = "inference.tasks.adapter_validate"
# Validation reads headers only and takes seconds: an adapter unvalidated this long was lost.
LOST_AFTER = timedelta(minutes=10)


def adapters_root() -> Path:
    return Path(settings.MEDIA_ROOT) / "adapters"


def adapter_dir(*, tenant_slug: str, name: str) -> Path:
    return adapters_root() / tenant_slug / name


def adapter_max_rank(*, deployment: ModelDeployment) -> int:
    """The engine's max_lora_rank for this deployment when its settings name one."""
    configured = (deployment.engine_settings or {}).get("max_lora_rank")
    return int(configured) if configured else settings.ADAPTER_MAX_RANK


def _new_version() -> str:
    # Sortable by time, unique across concurrent uploads of one name.
    return f"{timezone.now():%Y%m%d%H%M%S%f}-{secrets.token_hex(4)}"


def _prune_empty(path: Path) -> None:
    """Remove `path` and its parents up to MEDIA_ROOT/adapters while they are empty."""
    root = adapters_root()
    while path != root and root in path.parents:
        try:
            path.rmdir()
        except OSError:  # not empty (or already gone): stop
            return
        path = path.parent


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _prune_empty(path.parent)


def _check_name(*, name: str, allowed_models: Collection[str] | None) -> None:
    try:
        ADAPTER_NAME_VALIDATOR(name)
    except ValidationError as exc:
        raise InvalidRequestError(
            f"Invalid adapter name {name!r}: {exc.messages[0]}", param="name", code="invalid_name"
        ) from exc
    if allowed_models is not None and name in allowed_models:
        raise InvalidRequestError(
            f"`{name}` is the name of a model your tenant uses; give the adapter another name.",
            param="name",
            code="invalid_name",
        )


def _base_deployment(*, base_model: str, allowed_models: Collection[str] | None) -> ModelDeployment:
    deployment = ModelDeployment.objects.filter(name=base_model, enabled=True).first()
    if deployment is None or (allowed_models is not None and base_model not in allowed_models):
        raise InvalidRequestError(
            f"The base model `{base_model}` does not exist or you do not have access to it.",
            param="base_model",
            code="model_not_found",
        )
    if deployment.task != ModelDeployment.Task.GENERATE:
        raise InvalidRequestError(
            f"The base model `{base_model}` computes embeddings: LoRA adapters apply to generation models.",
            param="base_model",
            code="model_task_mismatch",
        )
    return deployment


def _check_room(*, tenant: Tenant, name: str) -> None:
    adapters = LoraAdapter.objects.filter(tenant=tenant)
    if not adapters.filter(name=name).exists() and adapters.count() >= settings.ADAPTER_MAX_PER_TENANT:
        raise InvalidRequestError(
            f"Your tenant already has {settings.ADAPTER_MAX_PER_TENANT} adapters, the most it may keep. "
            "Delete one first.",
            param="name",
            code="adapter_limit_reached",
        )


def _check_storage(*, tenant: Tenant, name: str, size: int) -> None:
    """The tenant's adapters, this one's new version counted instead of its current one, fit the
    tenant's storage (ADAPTER_STORAGE_PER_TENANT)."""
    kept = (
        LoraAdapter.objects.filter(tenant=tenant)
        .exclude(name=name)
        .aggregate(total=Sum("size_bytes"))["total"]
        or 0
    )
    limit = settings.ADAPTER_STORAGE_PER_TENANT
    if kept + size > limit:
        raise InvalidRequestError(
            f"This upload ({size} bytes) would take the tenant's adapters to {kept + size} bytes; the "
            f"tenant may store {limit}. Delete an adapter first.",
            param="file",
            code="adapter_storage_quota",
        )


def adapter_upload(
    *,
    tenant: Tenant,
    name: str,
    base_model: str,
    files: Sequence[Upload],
    created_by=None,
    allowed_models: Collection[str] | None = None,
) -> LoraAdapter:
    """Store an adapter (or a new version of one) and schedule its validation.

    `allowed_models`: the base models the uploader may use (None: any enabled deployment, for the
    platform operator). Raises InvalidRequestError (400) for anything refused."""
    _check_name(name=name, allowed_models=allowed_models)
    deployment = _base_deployment(base_model=base_model, allowed_models=allowed_models)
    _check_room(tenant=tenant, name=name)
    home = adapter_dir(tenant_slug=tenant.slug, name=name)
    version = _new_version()
    staging = home / f".upload-{version}"
    staging.mkdir(parents=True)
    try:
        size = stage_upload(files=files, target=staging, max_bytes=settings.ADAPTER_MAX_BYTES)
        _check_storage(tenant=tenant, name=name, size=size)
        final = home / version
        staging.rename(final)
    except BaseException:
        _remove_tree(staging)
        raise
    try:
        adapter, previous = _switch_version(
            tenant=tenant,
            name=name,
            deployment=deployment,
            version=version,
            path=final,
            size=size,
            created_by=created_by,
        )
    except BaseException:
        _remove_tree(final)
        raise
    transaction.on_commit(lambda: _remove_versions_before(home, version=previous or version))
    _schedule_validation(adapter_id=adapter.pk, version=version)
    return adapter


@transaction.atomic
def _switch_version(
    *, tenant: Tenant, name: str, deployment: ModelDeployment, version: str, path: Path, size: int, created_by
) -> tuple[LoraAdapter, str | None]:
    fresh = {
        "base_model": deployment,
        "version": version,
        "storage_path": str(path),
        "size_bytes": size,
        "status": LoraAdapter.Status.UPLOADED,
        "failure_reason": "",
        "rank": None,
        "alpha": None,
        "target_modules": [],
    }
    adapter = LoraAdapter.objects.select_for_update().filter(tenant=tenant, name=name).first()
    if adapter is None:
        try:
            with transaction.atomic():
                adapter = LoraAdapter.objects.create(tenant=tenant, name=name, created_by=created_by, **fresh)
        except IntegrityError as exc:
            raise InvalidRequestError(
                f"The adapter `{name}` is being uploaded by another request; try again.",
                param="name",
                code="conflict",
            ) from exc
        audit_record(action="create", obj=adapter, tenant_id=tenant.pk, after=audit_snapshot(adapter))
        return adapter, None
    previous = adapter.version
    before = audit_snapshot(adapter)
    for field, value in fresh.items():
        setattr(adapter, field, value)
    adapter.save()
    audit_record(
        action="upload", obj=adapter, tenant_id=tenant.pk, before=before, after=audit_snapshot(adapter)
    )
    return adapter, previous


def _remove_versions_before(home: Path, *, version: str) -> None:
    """Versions older than `version` go. The one just replaced stays, so a request queued against
    it before the switch can still be loaded by an engine; newer ones (a concurrent upload, maybe
    not switched to yet) are not this upload's to touch. Version names sort by time."""
    for child in home.iterdir() if home.is_dir() else ():
        if not child.name.startswith(".") and child.name < version:
            shutil.rmtree(child, ignore_errors=True)


def _schedule_validation(*, adapter_id: int, version: str) -> None:
    # By name: the task module imports this one, never the other way round (InferenceConfig.ready
    # registers the tasks in every process). robust: a broker outage must not fail the upload; the
    # adapter stays "uploaded" and is validated again by adapter_validate_lost or from the admin.
    task = signature(VALIDATE_TASK, args=(adapter_id, version))
    transaction.on_commit(task.delay, robust=True)


def adapter_revalidate(*, adapter: LoraAdapter) -> None:
    """Validate the current version again (e.g. after the base deployment changed)."""
    LoraAdapter.objects.filter(pk=adapter.pk).update(
        status=LoraAdapter.Status.UPLOADED, failure_reason="", updated_at=timezone.now()
    )
    _schedule_validation(adapter_id=adapter.pk, version=adapter.version)


def adapter_validate_lost(*, older_than: timedelta = LOST_AFTER) -> int:
    """Queue validation again for adapters whose result never came (the broker was down when
    they were uploaded, or a worker died mid-check). Returns how many were queued."""
    adapters = adapter_list_unvalidated(since_before=timezone.now() - older_than)
    for adapter in adapters:
        _schedule_validation(adapter_id=adapter.pk, version=adapter.version)
    return len(adapters)


def adapter_validate(*, adapter_id: int, version: str) -> str:
    """Check the stored files against the base model; set ready or failed. Returns the status.

    Idempotent: a version that was replaced meanwhile is left alone ("superseded"), a decided one
    is not checked twice."""
    with transaction.atomic():
        adapter = (
            LoraAdapter.objects.select_for_update()
            .select_related("base_model")
            .filter(pk=adapter_id, version=version)
            .first()
        )
        if adapter is None:
            return "superseded"
        if adapter.status in (LoraAdapter.Status.READY, LoraAdapter.Status.FAILED):
            return adapter.status
        adapter.status = LoraAdapter.Status.VALIDATING
        adapter.save(update_fields=["status", "updated_at"])
    deployment = adapter.base_model
    try:
        spec = adapter_check(
            adapter_dir=Path(adapter.storage_path),
            model_path=deployment.model_path,
            base_name=deployment.name,
            max_rank=adapter_max_rank(deployment=deployment),
        )
        outcome = {
            "status": LoraAdapter.Status.READY,
            "failure_reason": "",
            "rank": spec.rank,
            "alpha": spec.alpha,
            "target_modules": spec.target_modules,
        }
    except AdapterInvalid as exc:
        outcome = {"status": LoraAdapter.Status.FAILED, "failure_reason": exc.reason}
    except Exception:
        # Whatever the files do to the checks, the adapter ends decided: never "validating" for
        # ever, and never queued again by adapter_validate_lost.
        logger.exception("adapter %s (%s) could not be checked", adapter_id, version)
        outcome = {
            "status": LoraAdapter.Status.FAILED,
            "failure_reason": "The adapter could not be checked. Re-save it with PEFT and upload it again.",
        }
    updated = LoraAdapter.objects.filter(pk=adapter_id, version=version).update(
        **outcome, updated_at=timezone.now()
    )
    if not updated:
        return "superseded"
    logger.info("adapter %s (%s) is %s", adapter_id, version, outcome["status"])
    return str(outcome["status"])


def adapter_upload_for_member(
    *,
    user,
    tenant: Tenant,
    name: str,
    base_model: str,
    files: Sequence[Upload],
    allowed_models: Collection[str] | None = None,
) -> LoraAdapter:
    """adapter_upload by a dashboard user: owners and admins may, members may not
    (PermissionDeniedError), outsiders do not see the tenant (NotFoundError)."""
    membership_require_manager(user=user, tenant_id=tenant.pk, what="adapters")
    return adapter_upload(
        tenant=tenant,
        name=name,
        base_model=base_model,
        files=files,
        created_by=user,
        allowed_models=allowed_models,
    )


def adapter_delete_for_member(*, user, tenant_id: int, name: str) -> None:
    """adapter_delete by a dashboard user, under the same role rule as adapter_upload_for_member."""
    membership_require_manager(user=user, tenant_id=tenant_id, what="adapters")
    adapter_delete(tenant_id=tenant_id, name=name)


def adapter_delete(*, tenant_id: int, name: str) -> None:
    """Delete the tenant's adapter and, once committed, its files. Another tenant's adapter is
    not found, exactly as a missing one."""
    with transaction.atomic():
        adapter = (
            LoraAdapter.objects.select_for_update()
            .select_related("tenant")
            .filter(tenant_id=tenant_id, name=name)
            .first()
        )
        if adapter is None:
            raise adapter_not_found(name)
        home = adapter_dir(tenant_slug=adapter.tenant.slug, name=name)
        stored = Path(adapter.storage_path).parent
        audit_record(action="delete", obj=adapter, tenant_id=tenant_id, before=audit_snapshot(adapter))
        adapter.delete()
        transaction.on_commit(lambda: [_remove_tree(path) for path in {home, stored}])
