"""Admin for model deployments, with their live engine replicas read from the heartbeats."""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html, format_html_join

from inference.models import ModelDeployment
from inference.selectors import deployment_replicas


def _replica_rows(name: str):
    try:
        return deployment_replicas(name=name)
    except Exception:  # Redis down: the page still opens
        return None


@admin.register(ModelDeployment)
class ModelDeploymentAdmin(admin.ModelAdmin):
    list_display = ("name", "enabled", "max_model_len", "dtype", "live_replicas", "updated_at")
    list_filter = ("enabled", "dtype")
    search_fields = ("name", "model_path")
    readonly_fields = ("replicas", "created_at", "updated_at")
    fields = (
        "name", "model_path", "max_model_len", "dtype", "engine_settings", "enabled",
        "replicas", "created_at", "updated_at",
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
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} / {}</td></tr>",
            (
                # format_html escapes its arguments to strings first, so numbers are formatted here.
                (s.replica_id, s.num_running, s.num_waiting, f"{s.kv_cache_usage:.1%}", f"{s.prefix_cache_hit_rate:.1%}",
                 s.num_free_blocks, s.num_total_blocks)
                for s in stats
            ),
        )
        return format_html(
            "<table><thead><tr><th>replica</th><th>running</th><th>waiting</th><th>KV usage</th>"
            "<th>prefix hit rate</th><th>free / total blocks</th></tr></thead><tbody>{}</tbody></table>",
            rows,
        )
