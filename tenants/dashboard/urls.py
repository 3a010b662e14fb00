from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from tenants.dashboard import views

app_name = "dashboard"

urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="registration/login.html", redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.home, name="home"),
    path("switch/", views.switch, name="switch"),
    path("t/<slug:slug>/", views.overview, name="overview"),
    path("t/<slug:slug>/keys/", views.keys, name="keys"),
    path("t/<slug:slug>/keys/new/", views.key_create, name="key_create"),
    path("t/<slug:slug>/keys/<int:key_id>/", views.key_detail, name="key_detail"),
    path("t/<slug:slug>/keys/<int:key_id>/revoke/", views.key_revoke, name="key_revoke"),
    path("t/<slug:slug>/keys/<int:key_id>/rotate/", views.key_rotate, name="key_rotate"),
    path("t/<slug:slug>/usage/", views.usage, name="usage"),
    path("t/<slug:slug>/usage.csv", views.usage_export, name="usage_export"),
    path("t/<slug:slug>/playground/", views.playground, name="playground"),
    path("t/<slug:slug>/audit/", views.audit, name="audit"),
    path("t/<slug:slug>/alerts/", views.alerts, name="alerts"),
    path("t/<slug:slug>/audit.csv", views.audit_export, name="audit_export"),
]
