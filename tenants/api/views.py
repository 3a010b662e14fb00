"""GET /v1/usage."""

from __future__ import annotations

from datetime import date, timedelta

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers

from core.api.base import ApiView, StrictSerializer, validated
from core.api.openapi import api_errors, list_of
from core.errors import InvalidRequestError
from tenants.selectors import GROUP_BY_CHOICES, usage_summary
from tenants.usage_csv import CSV_GROUP_BY, usage_csv, usage_csv_filename

MAX_RANGE_DAYS = 366
# Day arithmetic past these (a default start 29 days back, an end's next midnight) would leave
# the calendar Python can represent.
EARLIEST_DAY, LATEST_DAY = date(1970, 1, 1), date(9999, 12, 30)


def _day_in_bounds(value: date) -> date:
    if not EARLIEST_DAY <= value <= LATEST_DAY:
        raise serializers.ValidationError(
            f"Dates must lie between {EARLIEST_DAY} and {LATEST_DAY}.", code="invalid_range"
        )
    return value


class _KeyPrefixField(serializers.CharField):
    """A key's visible prefix as the key itself begins (sk-...); none without a prefix."""

    def to_representation(self, value) -> str | None:
        return f"sk-{value}" if value else None


class UsageListApi(ApiView):
    """Usage of the calling key's tenant, in buckets per day, model or key."""

    required_scope = "manage"

    class InputSerializer(StrictSerializer):
        start = serializers.DateField(
            required=False,
            input_formats=["%Y-%m-%d"],
            validators=[_day_in_bounds],
            help_text="The first day (UTC), YYYY-MM-DD; by default 29 days before `end`.",
        )
        end = serializers.DateField(
            required=False,
            input_formats=["%Y-%m-%d"],
            validators=[_day_in_bounds],
            help_text="The last day (UTC), YYYY-MM-DD; by default today.",
        )
        group_by = serializers.CharField(
            required=False,
            help_text="One or more of day, model, key, comma-separated, each once; by default day "
            "(day,model,key for CSV).",
        )
        format = serializers.ChoiceField(
            choices=["json", "csv"],
            default="json",
            help_text="csv: the buckets as a CSV file (text/csv), a row each, with a header row.",
        )

        def validate_group_by(self, value: str) -> tuple[str, ...]:
            """One dimension or several, comma-separated: day, model, key."""
            dimensions = tuple(part.strip() for part in value.split(","))
            unknown = [d for d in dimensions if d not in GROUP_BY_CHOICES]
            if unknown or len(set(dimensions)) != len(dimensions):
                raise serializers.ValidationError(
                    f"group_by takes distinct names of {', '.join(GROUP_BY_CHOICES)}, comma-separated.",
                    code="invalid_choice",
                )
            return dimensions

    @extend_schema_serializer(component_name="UsageBucket")
    class OutputSerializer(serializers.Serializer):
        date = serializers.DateField(source="day", required=False)
        model = serializers.CharField(required=False)
        api_key_id = serializers.IntegerField(required=False)
        api_key_prefix = _KeyPrefixField(source="api_key__prefix", required=False)
        api_key_name = serializers.CharField(source="api_key__name", required=False)
        requests = serializers.IntegerField()
        errors = serializers.IntegerField()
        prompt_tokens = serializers.IntegerField()
        completion_tokens = serializers.IntegerField()
        cached_tokens = serializers.IntegerField()
        total_tokens = serializers.SerializerMethodField()
        # total_tokens at each request's price factor (Batch API lines count at BATCH_PRICE_FACTOR).
        billed_tokens = serializers.SerializerMethodField()

        def get_total_tokens(self, bucket: dict) -> int:
            return int(bucket["prompt_tokens"] or 0) + int(bucket["completion_tokens"] or 0)

        def get_billed_tokens(self, bucket: dict) -> float:
            return float(bucket.get("billed_tokens") or 0)

        def to_representation(self, instance):
            data = super().to_representation(instance)
            if data.get("api_key_prefix") is None:
                data.pop("api_key_prefix", None)
            return data

    @extend_schema(
        operation_id="listUsage",
        summary="The organization's usage",
        description="Requests, errors and tokens per day, model or key (or several, comma-separated).",
        parameters=[InputSerializer],
        responses={
            (200, "application/json"): list_of(
                "UsageList",
                OutputSerializer,
                start=serializers.DateField(),
                end=serializers.DateField(),
                group_by=serializers.CharField(),
            ),
            (200, "text/csv"): OpenApiTypes.STR,
            **api_errors(400),
        },
    )
    def get(self, request):
        params = validated(self.InputSerializer, request.GET)
        end = params.get("end") or timezone.now().date()
        start = params.get("start") or end - timedelta(days=29)
        if start > end:
            raise InvalidRequestError("start must not be after end.", param="start", code="invalid_range")
        if (end - start).days >= MAX_RANGE_DAYS:
            raise InvalidRequestError(
                f"The range may span at most {MAX_RANGE_DAYS} days.", param="start", code="invalid_range"
            )
        if params["format"] == "csv":
            group_by = params.get("group_by") or CSV_GROUP_BY
            response = HttpResponse(
                usage_csv(tenant_id=self.auth.tenant_id, start=start, end=end, group_by=group_by),
                content_type="text/csv; charset=utf-8",
            )
            filename = usage_csv_filename(tenant_slug=self.auth.tenant_slug, start=start, end=end)
            response["Content-Disposition"] = f'attachment; filename="{filename}"'
            return response
        group_by = params.get("group_by") or ("day",)
        buckets = usage_summary(tenant_id=self.auth.tenant_id, start=start, end=end, group_by=group_by)
        return {
            "object": "list",
            "start": start.isoformat(),
            "end": end.isoformat(),
            "group_by": ",".join(group_by),
            "data": self.OutputSerializer(buckets, many=True).data,
        }
