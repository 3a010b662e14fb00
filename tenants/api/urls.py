from __future__ import annotations

from django.urls import path

from tenants.api.views import UsageListApi

urlpatterns = [
    path("usage", UsageListApi.as_view(), name="usage-list"),
]
