"""Models as the platform sees them. Thin: fields, constraints and one-row properties."""

from __future__ import annotations

from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

# Served names travel in Redis key names and URL paths: keep them to a safe alphabet.
SERVED_NAME_VALIDATOR = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$",
    "Letters, digits and . _ - / only, starting with a letter or digit.",
)


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
    engine_settings = models.JSONField(
        default=dict, blank=True, help_text="Extra engine options (block size, memory budget, ...)."
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
