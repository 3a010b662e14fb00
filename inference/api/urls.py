from __future__ import annotations

from django.urls import path

from inference.api.adapters import AdapterDetailApi, AdapterListCreateApi
from inference.api.anthropic.views import MessageCountTokensApi, MessageCreateApi
from inference.api.chat_completions.views import ChatCompletionCreateApi
from inference.api.completions.views import CompletionCreateApi
from inference.api.embeddings.views import EmbeddingCreateApi
from inference.api.openai_responses.views import ResponseCreateApi, ResponseDetailApi, ResponseInputItemsApi
from inference.api.views import ModelListApi, ModelRetrieveApi

urlpatterns = [
    path("models", ModelListApi.as_view(), name="v1-models"),
    # Model names may hold slashes (org/name), as OpenAI's and vLLM's do.
    path("models/<path:model>", ModelRetrieveApi.as_view(), name="v1-model-detail"),
    path("completions", CompletionCreateApi.as_view(), name="v1-completions"),
    path("chat/completions", ChatCompletionCreateApi.as_view(), name="v1-chat-completions"),
    path("messages", MessageCreateApi.as_view(), name="v1-messages"),
    path("messages/count_tokens", MessageCountTokensApi.as_view(), name="v1-messages-count-tokens"),
    path("embeddings", EmbeddingCreateApi.as_view(), name="v1-embeddings"),
    path("responses", ResponseCreateApi.as_view(), name="v1-responses"),
    path("responses/<str:response_id>", ResponseDetailApi.as_view(), name="v1-response-detail"),
    path(
        "responses/<str:response_id>/input_items",
        ResponseInputItemsApi.as_view(),
        name="v1-response-input-items",
    ),
    path("adapters", AdapterListCreateApi.as_view(), name="v1-adapters"),
    path("adapters/<str:name>", AdapterDetailApi.as_view(), name="v1-adapter-detail"),
]
