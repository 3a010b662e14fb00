"""What every sync /v1 DRF view shares: API-key authentication, request rate limits and the
x-ratelimit-* headers on every answer, and serializers that refuse unknown fields."""

from __future__ import annotations

from collections.abc import Mapping

from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail
from rest_framework.views import APIView

from core.errors import PlatformError
from tenants.authentication import ApiKeyAuthentication
from tenants.services import request_admit


class StrictSerializer(serializers.Serializer):
    """Unknown fields are an error (OpenAI: "Unrecognized request argument supplied")."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            unknown = [name for name in data if name not in self.fields]
            if unknown:
                message = f"Unrecognized request argument supplied: {unknown[0]}"
                raise serializers.ValidationError(
                    {unknown[0]: [ErrorDetail(message, code="unknown_parameter")]}
                )
        return super().to_internal_value(data)


class TenantApiView(APIView):
    """Base for /v1 views that do not reserve tokens: each request counts against requests/min."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes: list = []
    ratelimit_headers: dict[str, str]

    def initial(self, request, *args, **kwargs) -> None:
        self.ratelimit_headers = {}
        super().initial(request, *args, **kwargs)
        self.ratelimit_headers = request_admit(auth=request.auth)

    def handle_exception(self, exc):
        if isinstance(exc, PlatformError) and exc.status_code == 429:
            self.ratelimit_headers = {}  # the error carries its own, fresher ones
        return super().handle_exception(exc)

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        for name, value in getattr(self, "ratelimit_headers", {}).items():
            response[name] = value
        return response
