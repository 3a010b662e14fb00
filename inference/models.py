"""Models as the platform sees them. Thin: fields, constraints and one-row properties."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from engine.rules import engine_settings_errors
from inference.reasoning import PARSERS as REASONING_PARSERS
from inference.tool_parsers import DEFAULT_PARSER, PARSERS

# Served names travel in Redis key names and URL paths: keep them to a safe alphabet.
SERVED_NAME_VALIDATOR = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$",
    "Letters, digits and . _ - / only, starting with a letter or digit.",
)


def validate_engine_settings(value: object) -> None:
    """The engine options a deployment may set (engine.rules), checked wherever one is saved."""
    errors = engine_settings_errors(value)
    if errors:
        raise ValidationError(errors)


class ModelDeployment(models.Model):
    """A model the platform serves. Which tenants may call it is part of each tenant's limits
    (`TenantLimits.allowed_models` lists served names); the engine replicas are separate processes
    that announce themselves through Redis heartbeats."""

    class Dtype(models.TextChoices):
        AUTO = "auto", "auto (from the checkpoint)"
        FLOAT32 = "float32", "float32"
        FLOAT16 = "float16", "float16"
        BFLOAT16 = "bfloat16", "bfloat16"

    name = models.CharField(
        max_length=128,
        unique=True,
        validators=[SERVED_NAME_VALIDATOR],
        help_text="Served name: what clients put in `model`.",
    )
    model_path = models.CharField(
        max_length=500, help_text="Hugging Face model directory (config.json, *.safetensors, tokenizer)."
    )
    max_model_len = models.PositiveIntegerField(
        validators=[MinValueValidator(1)], help_text="Prompt plus completion tokens, at most."
    )
    dtype = models.CharField(max_length=16, choices=Dtype.choices, default=Dtype.AUTO)

    class Task(models.TextChoices):
        GENERATE = "generate", "Generate (chat, completions, responses, messages)"
        EMBED = "embed", "Embed (/v1/embeddings)"

    # An encoder (BERT family) embeds; a decoder generates, or embeds when the operator says it is an
    # embedding model built on a decoder (model_register --task embed, or the admin).
    task = models.CharField(
        max_length=16,
        choices=Task.choices,
        default=Task.GENERATE,
        help_text="Embed: an embedding model (an encoder always embeds; a decoder pools its last token).",
    )
    engine_settings = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_engine_settings],
        help_text="Extra engine options (block size, memory budget, ...): the engine_settings keys in the README.",
    )

    tool_call_parser = models.CharField(
        max_length=32,
        # The parsers of inference.tool_parsers (the one list), or none.
        choices=[
            *((name, label) for name, (_, label) in PARSERS.items()),
            ("", "none (no automatic tool choice)"),
        ],
        default=DEFAULT_PARSER,
        blank=True,
        help_text="How tool calls are read from this model's output when tool_choice is auto. Templates "
        "that do not render tools get them described in the Hermes format.",
    )
    reasoning_parser = models.CharField(
        max_length=32,
        # The parsers of inference.reasoning, or none.
        choices=[("", "none (the answer is all content)"), *REASONING_PARSERS.items()],
        default="",
        blank=True,
        help_text="How a reasoning model's thinking is read apart from its answer: chat completions "
        "return it as reasoning_content.",
    )
    enabled = models.BooleanField(default=True)
    max_queued_requests = models.PositiveIntegerField(
        null=True,
        blank=True,
        default=256,
        help_text="Requests waiting to start on this model, all tenants together; beyond it a 429 "
        "with Retry-After. Empty: unlimited.",
    )
    prefix_routing = models.BooleanField(
        default=True,
        help_text="Queue each request to the replica that holds its prompt's prefix in cache (by tenant "
        "and prompt, or prompt_cache_key), within a bounded load; idle replicas take what waits. Off: "
        "every replica reads one shared queue.",
    )
    replica_wait_seconds = models.PositiveIntegerField(
        default=0,
        help_text="With no ready replica, a request waits this long, queued, for one to start (a model "
        "an autoscaler scales to zero wakes on the queue) before a 503 engine_unavailable; it is "
        "dropped unbilled if none started it by then. 0: the 503 comes at once.",
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


# Adapter names are the `model` of a request, a path segment of /v1/adapters/{name} and a directory
# name on disk: no slash, no leading dot.
ADAPTER_NAME_VALIDATOR = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$",
    "Letters, digits and . _ - only, starting with a letter or digit, at most 64 characters.",
)


class LoraAdapter(models.Model):
    """A tenant's LoRA adapter (PEFT format) served on one base deployment.

    `version` names the directory the current files live in; a re-upload writes a new version
    directory and then switches the row to it, so readers never see half-written files."""

    class Status(models.TextChoices):
        UPLOADED = "uploaded", "Uploaded"
        VALIDATING = "validating", "Validating"
        READY = "ready", "Ready"
        FAILED = "failed", "Failed"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="lora_adapters")
    name = models.CharField(
        max_length=64, validators=[ADAPTER_NAME_VALIDATOR], help_text="What clients put in `model`."
    )
    base_model = models.ForeignKey(ModelDeployment, on_delete=models.PROTECT, related_name="lora_adapters")
    rank = models.PositiveIntegerField(null=True, blank=True)
    alpha = models.FloatField(null=True, blank=True)
    target_modules = models.JSONField(default=list, blank=True)
    size_bytes = models.PositiveBigIntegerField(default=0)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.UPLOADED)
    failure_reason = models.TextField(blank=True, default="")
    version = models.CharField(max_length=32)
    storage_path = models.CharField(max_length=500, help_text="Directory of the current version's files.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tenant_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="lora_adapter_tenant_name_unique")
        ]

    def __str__(self) -> str:
        return self.name


class StoredResponse(models.Model):
    """A response of the Responses API kept for `GET /v1/responses/{id}` and for the next turn's
    `previous_response_id` (`store`, true by default). In the database, so every web process
    serves every stored response and a restart loses none.

    A conversation is the chain of `previous_id` links; `root_id` and `depth` let one query fetch a
    chain. `messages` holds this turn's input and output as chat messages (what the next turn's
    prompt repeats; instructions are not carried over, as OpenAI's are not), `input_items` the input
    as the client sent it (with ids), `body` the response object. `size_bytes` counts against the
    tenant's bound (RESPONSES_STORAGE_PER_TENANT); rows past `expires_at` are gone for every
    reader and deleted by a periodic task."""

    id = models.CharField(primary_key=True, max_length=80)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="stored_responses")
    # Not a foreign key: a deleted turn must leave its successors pointing at the gap.
    previous_id = models.CharField(max_length=80, null=True, blank=True)
    root_id = models.CharField(max_length=80, db_index=True)
    depth = models.PositiveIntegerField(default=0)
    model = models.CharField(max_length=200)
    body = models.JSONField()
    input_items = models.JSONField(default=list)
    messages = models.JSONField(default=list)
    size_bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "created_at"], name="stored_response_tenant_created")]

    def __str__(self) -> str:
        return self.id
