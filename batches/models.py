"""The Batch API's records: tenants' files (`/v1/files`), their batches (`/v1/batches`) and each line
of a batch, whose state is what makes a restarted runner resume without running a line twice."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class File(models.Model):
    """A tenant's file: a batch's input (uploaded, purpose `batch`) or its output or error lines
    (written by the runner, purpose `batch_output`). Its bytes are in the storage backend."""

    class Purpose(models.TextChoices):
        BATCH = "batch", "Batch input"
        BATCH_OUTPUT = "batch_output", "Batch output"

    id = models.CharField(primary_key=True, max_length=40)  # file-<hex>
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    lines = models.PositiveIntegerField(default=0)
    content = models.FileField(upload_to="files/", max_length=255)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "created_at"], name="file_tenant_created")]

    def __str__(self) -> str:
        return self.id


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating", "Validating"
        FAILED = "failed", "Failed"
        IN_PROGRESS = "in_progress", "In progress"
        FINALIZING = "finalizing", "Finalizing"
        COMPLETED = "completed", "Completed"
        EXPIRED = "expired", "Expired"
        CANCELLING = "cancelling", "Cancelling"
        CANCELLED = "cancelled", "Cancelled"

    # Statuses a runner still has work in.
    ACTIVE = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)

    id = models.CharField(primary_key=True, max_length=40)  # batch_<hex>
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="batches")
    # The key that created it: its lines run as that key (PROTECT: keys are revoked, not deleted).
    api_key = models.ForeignKey("tenants.ApiKey", on_delete=models.PROTECT, related_name="batches")
    endpoint = models.CharField(max_length=64)
    # Ids, not foreign keys: a batch keeps naming its files after they are deleted, as OpenAI's do.
    input_file_id = models.CharField(max_length=40)
    output_file_id = models.CharField(max_length=40, blank=True, default="")
    error_file_id = models.CharField(max_length=40, blank=True, default="")
    completion_window = models.CharField(max_length=8, default="24h")
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    errors = models.JSONField(null=True, blank=True)  # why validation failed the whole batch
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"
        indexes = [
            models.Index(fields=["tenant", "created_at"], name="batch_tenant_created"),
            models.Index(fields=["status"], name="batch_status"),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def done(self) -> int:
        return self.completed + self.failed


class BatchRequest(models.Model):
    """One line of a batch's input file. `attempt` counts the engine submissions made for it: a
    runner that resumes a line whose last attempt reached the engines reads that attempt's output
    instead of submitting again, so no line runs twice."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="requests")
    index = models.PositiveIntegerField()  # its line in the input file, from 0
    custom_id = models.CharField(max_length=512, null=True, blank=True)
    body = models.JSONField(null=True, blank=True)  # the request body; None for a malformed line
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempt = models.PositiveIntegerField(default=0)
    request_id = models.CharField(max_length=64, blank=True, default="")
    response = models.JSONField(null=True, blank=True)  # {status_code, request_id, body}
    error = models.JSONField(null=True, blank=True)  # {code, message}, for a line with no response

    class Meta:
        ordering = ["batch", "index"]
        constraints = [models.UniqueConstraint(fields=["batch", "index"], name="batch_request_line")]
        indexes = [models.Index(fields=["batch", "status"], name="batch_request_status")]

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.index}"
