from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import include, path, re_path

from core.api.openapi import OpenApiSchemaApi
from core.api.views import v1_not_found
from inference import health
from inference.api.tokens import DetokenizeApi, TokenizeApi

urlpatterns = [
    path("live", health.live),
    path("health", health.live),  # the older name of /live
    path("ready", health.ready),
    path("metrics", health.metrics),
    # vLLM serves these beside /v1, not under it.
    path("tokenize", TokenizeApi.as_view(), name="tokenize"),
    path("detokenize", DetokenizeApi.as_view(), name="detokenize"),
    path("admin/", admin.site.urls),
    path("dashboard/", include("tenants.dashboard.urls")),
    path("dashboard/", include("inference.dashboard.urls")),
    path("dashboard/", include("batches.dashboard.urls")),
    path("v1/openapi.json", OpenApiSchemaApi.as_view(), name="openapi-schema"),
    path("v1/", include("tenants.api.urls")),
    path("v1/", include("inference.api.urls")),
    path("v1/", include("batches.api.urls")),
    # Add further /v1 routes ABOVE this line: this catch-all must stay the last /v1 pattern, so
    # unknown /v1 URLs answer 404 in the OpenAI error shape instead of an HTML page.
    re_path(r"^v1(/.*)?$", v1_not_found),
]

if settings.SSO_ENABLED:
    # /oidc/authenticate/ starts the code flow; the identity provider returns to /oidc/callback/.
    urlpatterns.append(path("oidc/", include("mozilla_django_oidc.urls")))
