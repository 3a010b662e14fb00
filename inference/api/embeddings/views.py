"""The view of POST /v1/embeddings: the body checked, planned into one embed request of the model's
engines by the one generation service (auth, rate limits, quota, tiers, fair share, ledger as for a
chat), and answered in OpenAI's shape: floats, or base64 of little-endian float32, each vector cut
to `dimensions` and renormalized when asked."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from django.http import HttpRequest, HttpResponse
from drf_spectacular.utils import extend_schema

from core.api.base import json_body
from core.api.openapi import api_errors
from core.concurrency import blocking
from core.errors import InvalidRequestError, PlatformError
from inference.api.base import CountedRefusalsApi, generation_input
from inference.api.body_json import body_json
from inference.api.embeddings.schema import EmbeddingInputSerializer, EmbeddingListSerializer
from inference.services import ChoiceFinished, Generation, GenerationPlan, GenerationUsage


def embedding_vectors(
    plan: GenerationPlan, finished: dict[int, str], dimensions: int | None
) -> list[np.ndarray]:
    vectors = []
    for index in range(plan.n):
        vector = np.frombuffer(base64.b64decode(finished[index]), dtype="<f4")
        if dimensions is not None:
            if dimensions > vector.shape[0]:
                raise InvalidRequestError(
                    f"dimensions may be at most {vector.shape[0]} for the model `{plan.served_model}`.",
                    param="dimensions",
                )
            vector = vector[:dimensions]
            norm = float(np.linalg.norm(vector))
            vector = vector / norm if norm > 0 else vector
        vectors.append(vector.astype("<f4"))
    return vectors


def embedding_list_body(
    plan: GenerationPlan, vectors: list[np.ndarray], usage: GenerationUsage, encoding_format: str
) -> dict[str, Any]:
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(v.tobytes()).decode()
            if encoding_format == "base64"
            else v.tolist(),
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": plan.served_model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


async def embedding_answer(
    generation: Generation, events: AsyncIterator, data: dict[str, Any]
) -> dict[str, Any]:
    """The list body of a started embedding generation, its events drained (the view's answer,
    and a batch line's)."""
    plan = generation.plan
    finished: dict[int, str] = {}
    async for item in events:
        if isinstance(item, ChoiceFinished) and item.embedding is not None:
            finished[item.index] = item.embedding
    if len(finished) != plan.n:
        raise PlatformError("The engine answered without every embedding.")
    vectors = embedding_vectors(plan, finished, data.get("dimensions"))
    return embedding_list_body(plan, vectors, generation.usage, data.get("encoding_format") or "float")


def _body(request: HttpRequest) -> dict[str, Any]:
    return generation_input(json_body(request), EmbeddingInputSerializer)


class EmbeddingCreateApi(CountedRefusalsApi):
    @extend_schema(
        operation_id="createEmbedding",
        summary="Create embeddings",
        request=EmbeddingInputSerializer,
        responses={200: EmbeddingListSerializer, **api_errors(400, 404, 413)},
    )
    async def post(self, request: HttpRequest) -> HttpResponse:
        generation, events, data = await self.start_generation(request, kind="embedding", read=_body)
        body = await blocking(body_json)(await embedding_answer(generation, events, data))
        return HttpResponse(body, content_type="application/json")
