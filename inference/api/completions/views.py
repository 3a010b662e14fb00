"""The view of POST /v1/completions."""

from __future__ import annotations

from inference.api.base import GenerationApi
from inference.api.completions.render import CompletionStream, text_completion_body
from inference.api.completions.schema import CompletionInputSerializer, CompletionSerializer


class CompletionCreateApi(GenerationApi):
    kind = "completion"
    InputSerializer = CompletionInputSerializer
    OutputSerializer = CompletionSerializer
    Stream = CompletionStream
    render_body = staticmethod(text_completion_body)
    operation_id, summary = "createCompletion", "Create a text completion"
