"""Admin for model deployments (with their live engine replicas read from the heartbeats) and
tenants' LoRA adapters (uploaded here through the same service as the API and the dashboard), and the
Responses API's stored responses."""

from __future__ import annotations

from pathlib import Path

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.utils.html import format_html, format_html_join

from core.errors import InvalidRequestError
from inference.forms import AdminAdapterUploadForm
from inference.models import LoraAdapter, ModelDeployment, StoredResponse
from inference.selectors import deployment_list_enabled, deployment_replicas
from inference.services.adapters import adapter_delete, adapter_revalidate, adapter_upload
from inference.services.deployments import ModelDirectoryError, model_facts
from tenants.admin_audit import AuditedAdmin


def _replica_rows(name: str):
    try:
        return deployment_replicas(name=name)
    except Exception:  # Redis down: the page still opens
        return None


class ModelDeploymentForm(forms.ModelForm):
    class Meta:
        model = ModelDeployment
        fields = "__all__"

    def clean_model_path(self) -> str:
        """Only a directory under PAGODA_MODELS_DIR: the admin must not point engines (and the web
        tier's tokenizer loading) at arbitrary paths of the host. Stored resolved, so `..` and
        symbolic links cannot lead out afterwards."""
        root = Path(settings.MODELS_DIR).expanduser().resolve()
        path = Path(self.cleaned_data["model_path"]).expanduser()
        resolved = (path if path.is_absolute() else root / path).resolve()
        if not resolved.is_relative_to(root):
            raise forms.ValidationError(f"The model directory must be inside PAGODA_MODELS_DIR ({root}).")
        if not (resolved / "config.json").is_file():
            raise forms.ValidationError("No config.json in that directory: it is not a model directory.")
        try:
            model_facts(model_path=resolved)  # an architecture the engine serves
        except ModelDirectoryError as exc:
            raise forms.ValidationError(str(exc)) from None
        return str(resolved)

    def clean(self) -> dict:
        """The task must be one the checkpoint allows: a decoder generates, or embeds when it is an
        embedding model built on a decoder; an encoder only embeds, so its task is set to embed."""
        cleaned = super().clean()
        path, task = cleaned.get("model_path"), cleaned.get("task")
        if path and task:
            try:
                if model_facts(model_path=Path(path))[1] == ModelDeployment.Task.EMBED:
                    cleaned["task"] = self.instance.task = ModelDeployment.Task.EMBED
                else:
                    model_facts(model_path=Path(path), task=task)
            except InvalidRequestError as exc:
                self.add_error("task", str(exc.message))
        return cleaned


@admin.register(ModelDeployment)
class ModelDeploymentAdmin(AuditedAdmin):
    form = ModelDeploymentForm
    list_display = ("name", "task", "enabled", "max_model_len", "dtype", "live_replicas", "updated_at")
    list_filter = ("enabled", "task", "dtype")
    search_fields = ("name", "model_path")
    readonly_fields = ("replicas", "created_at", "updated_at")
    fields = (
        "name",
        "model_path",
        "task",
        "max_model_len",
        "dtype",
        "tool_call_parser",
        "reasoning_parser",
        "engine_settings",
        "prefix_routing",
        "max_queued_requests",
        "replica_wait_seconds",
        "enabled",
        "replicas",
        "created_at",
        "updated_at",
    )

    @admin.display(description="live replicas")
    def live_replicas(self, obj: ModelDeployment) -> str:
        stats = _replica_rows(obj.name)
        return "?" if stats is None else str(len(stats))

    @admin.display(description="engine replicas (from heartbeats)")
    def replicas(self, obj: ModelDeployment) -> str:
        if obj.pk is None:
            return "-"
        stats = _replica_rows(obj.name)
        if stats is None:
            return "Redis is unreachable."
        if not stats:
            return "No live replica."
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} / {}</td><td>{} / {}</td></tr>",
            (
                # format_html escapes its arguments to strings first, so numbers are formatted here.
                (
                    f"{s.replica_id} (draining)" if s.draining else s.replica_id,
                    s.num_running,
                    s.num_waiting,
                    f"{s.kv_cache_usage:.1%}",
                    f"{s.prefix_cache_hit_rate:.1%}",
                    s.num_free_blocks,
                    s.num_total_blocks,
                    s.num_routed_requests,
                    s.num_stolen_requests,
                )
                for s in stats
            ),
        )
        return format_html(
            "<table><thead><tr><th>replica</th><th>running</th><th>waiting</th><th>KV usage</th>"
            "<th>prefix hit rate</th><th>free / total blocks</th><th>routed / stolen requests</th></tr></thead>"
            "<tbody>{}</tbody></table>",
            rows,
        )


_UPLOAD_FIELDS = {"name": "name", "base_model": "base_model", "file": "files"}


@admin.register(LoraAdapter)
class LoraAdapterAdmin(AuditedAdmin):
    list_display = ("name", "tenant", "base_model", "status", "rank", "size_bytes", "updated_at")
    list_filter = ("status", "base_model", "tenant")
    search_fields = ("name", "tenant__slug")
    list_select_related = ("tenant", "base_model")
    actions = ("revalidate_selected",)
    upload_template = "admin/inference/loraadapter/upload.html"
    readonly_fields = (
        "tenant",
        "name",
        "base_model",
        "status",
        "failure_reason",
        "rank",
        "alpha",
        "target_modules",
        "size_bytes",
        "version",
        "storage_path",
        "created_by",
        "created_at",
        "updated_at",
    )
    fields = readonly_fields

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # shown read-only: an adapter changes only by being uploaded again

    def add_view(self, request, form_url="", extra_context=None):
        """Adding an adapter is uploading one: files, not fields."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        base_models = [d.name for d in deployment_list_enabled()]
        form = AdminAdapterUploadForm(request.POST or None, request.FILES or None, base_models=base_models)
        if request.method == "POST" and form.is_valid():
            try:
                with transaction.atomic():
                    adapter = adapter_upload(
                        tenant=form.cleaned_data["tenant"],
                        name=form.cleaned_data["name"],
                        base_model=form.cleaned_data["base_model"],
                        files=form.cleaned_data["files"],
                        created_by=request.user,
                    )
            except InvalidRequestError as exc:
                form.add_error(_UPLOAD_FIELDS.get(exc.param or ""), exc.message)
            else:
                self.log_addition(request, adapter, [{"added": {}}])
                self.message_user(request, f"Adapter “{adapter.name}” was uploaded; it is being validated.")
                return redirect("admin:inference_loraadapter_change", adapter.pk)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "form": form,
            "title": "Upload a LoRA adapter",
        }
        return TemplateResponse(request, self.upload_template, context, status=400 if form.errors else 200)

    def delete_model(self, request, obj: LoraAdapter) -> None:
        adapter_delete(tenant_id=obj.tenant_id, name=obj.name)

    def delete_queryset(self, request, queryset) -> None:
        for adapter in queryset.order_by("pk"):
            adapter_delete(tenant_id=adapter.tenant_id, name=adapter.name)

    def has_revalidate_permission(self, request) -> bool:
        # The page is read-only for everyone, but scheduling work is a change.
        return request.user.has_perm("inference.change_loraadapter")

    @admin.action(description="Validate selected adapters again", permissions=["revalidate"])
    def revalidate_selected(self, request, queryset) -> None:
        count = 0
        for adapter in queryset.order_by("pk"):
            adapter_revalidate(adapter=adapter)
            count += 1
        self.message_user(request, f"Validation scheduled for {count} adapter(s).", messages.SUCCESS)


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    """The Responses API's stored responses: read-only (they are written by the API), deletable."""

    list_display = ("id", "tenant", "model", "depth", "size_bytes", "created_at", "expires_at")
    list_filter = ("tenant", "model")
    search_fields = ("id", "root_id", "tenant__slug")
    list_select_related = ("tenant",)
    date_hierarchy = "created_at"
    readonly_fields = (
        "id",
        "tenant",
        "model",
        "previous_id",
        "root_id",
        "depth",
        "size_bytes",
        "created_at",
        "expires_at",
        "body",
        "input_items",
        "messages",
    )
    fields = readonly_fields

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
