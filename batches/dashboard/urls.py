from __future__ import annotations

from django.urls import path

from batches.dashboard import views

app_name = "batches"

urlpatterns = [
    path("t/<slug:slug>/batches/", views.batches, name="batches"),
    path("t/<slug:slug>/batches/<str:batch_id>/cancel/", views.batch_cancel, name="batch_cancel"),
    path("t/<slug:slug>/files/<str:file_id>/", views.file_download, name="file_download"),
]
