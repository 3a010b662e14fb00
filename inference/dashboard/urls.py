from __future__ import annotations

from django.urls import path

from inference.dashboard import views

app_name = "adapters"

urlpatterns = [
    path("t/<slug:slug>/adapters/", views.adapters, name="adapters"),
    path("t/<slug:slug>/adapters/new/", views.adapter_create, name="adapter_create"),
    path("t/<slug:slug>/adapters/<str:name>/delete/", views.adapter_remove, name="adapter_delete"),
]
