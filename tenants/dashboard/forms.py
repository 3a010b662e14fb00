from __future__ import annotations

from datetime import datetime, timedelta

from django import forms
from django.utils import timezone

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

    def expires_at(self, *, now: datetime | None = None) -> datetime | None:
        days = self.cleaned_data.get("expires_in_days")
        return None if days is None else (now or timezone.now()) + timedelta(days=days)
