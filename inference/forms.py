"""The adapter upload form, shared by the tenant dashboard and the admin."""

from __future__ import annotations

from django import forms

from inference.models import ADAPTER_NAME_VALIDATOR
from tenants.models import Tenant


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class MultipleFileField(forms.FileField):
    """Several files under one name (Django's documented pattern)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("widget", MultipleFileInput(attrs={"accept": ".json,.safetensors,.zip"}))
        super().__init__(*args, **kwargs)

    def clean(self, data, initial=None):
        single = super().clean
        if isinstance(data, list | tuple):
            return [single(item, initial) for item in data]
        return [single(data, initial)]


class AdapterUploadForm(forms.Form):
    name = forms.CharField(
        max_length=64,
        validators=[ADAPTER_NAME_VALIDATOR],
        widget=forms.TextInput(attrs={"placeholder": "e.g. support-tone", "autocomplete": "off"}),
        help_text="Clients put this in `model`. Uploading an existing name replaces that adapter.",
    )
    base_model = forms.ChoiceField(label="Base model")
    files = MultipleFileField(
        label="Files",
        help_text="adapter_config.json and adapter_model.safetensors, or one .zip holding them.",
    )

    def __init__(self, *args, base_models: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["base_model"].choices = [(name, name) for name in base_models]


class AdminAdapterUploadForm(AdapterUploadForm):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.order_by("name"))

    field_order = ["tenant", "name", "base_model", "files"]
