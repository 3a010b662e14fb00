from __future__ import annotations

from datetime import datetime, timedelta

from django import forms
from django.utils import timezone

from tenants.models import ApiKey

EXPIRY_CHOICES = [
    ("", "Never"),
    ("7", "In 7 days"),
    ("30", "In 30 days"),
    ("90", "In 90 days"),
    ("365", "In 1 year"),
]


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(
        max_length=100,
        strip=True,
        widget=forms.TextInput(attrs={"placeholder": "e.g. production backend", "autocomplete": "off"}),
    )
    expires_in_days = forms.TypedChoiceField(
        choices=EXPIRY_CHOICES, coerce=int, empty_value=None, required=False, label="Expires"
    )
    scope = forms.TypedChoiceField(
        choices=ApiKey.Scope.choices, initial=ApiKey.Scope.ALL, empty_value=ApiKey.Scope.ALL, required=False
    )
    models = forms.MultipleChoiceField(
        choices=(),
        required=False,
        label="Models",
        help_text="None selected: every model of the tenant.",
        widget=forms.CheckboxSelectMultiple,
    )
    requests_per_minute = forms.IntegerField(min_value=1, required=False, label="Requests / minute")
    tokens_per_minute = forms.IntegerField(min_value=1, required=False, label="Tokens / minute")
    monthly_token_budget = forms.IntegerField(min_value=1, required=False, label="Monthly token budget")

    def __init__(self, *args, tenant_models: tuple[str, ...] | list[str] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["models"].choices = [(m, m) for m in tenant_models]

    def expires_at(self, *, now: datetime | None = None) -> datetime | None:
        days = self.cleaned_data.get("expires_in_days")
        return None if days is None else (now or timezone.now()) + timedelta(days=days)

    def allowed_models(self) -> list[str] | None:
        return list(self.cleaned_data["models"]) or None


ROTATION_GRACE_CHOICES = [
    ("0", "None: the old secret stops at once"),
    ("1", "1 hour"),
    ("24", "24 hours"),
    ("168", "7 days"),
]


class ApiKeyRotateForm(forms.Form):
    grace_hours = forms.TypedChoiceField(
        choices=ROTATION_GRACE_CHOICES, coerce=int, initial="24", label="Keep the old secret valid for"
    )

    def grace(self) -> timedelta:
        return timedelta(hours=self.cleaned_data["grace_hours"])


class AlertSettingsForm(forms.Form):
    thresholds = forms.CharField(
        max_length=60, help_text="Percents of the monthly quota and of each key's budget, comma-separated."
    )
    email = forms.BooleanField(required=False, label="E-mail the owners and admins")
    webhook_url = forms.URLField(required=False, max_length=500, assume_scheme="https", label="Webhook URL")
    rate_limit_hits = forms.IntegerField(
        min_value=0, label="Rate-limit refusals in an hour that raise an alert (0: none)"
    )

    def clean_thresholds(self) -> list[int]:
        try:
            return [int(part) for part in self.cleaned_data["thresholds"].split(",") if part.strip()]
        except ValueError:
            raise forms.ValidationError("Whole percents, comma-separated: 80, 100.") from None
