"""The view of POST /v1/chat/completions."""

from __future__ import annotations

from inference.api.base import GenerationApi
from inference.api.chat_completions.render import ChatStream, chat_completion_body
from inference.api.chat_completions.schema import ChatCompletionInputSerializer, ChatCompletionSerializer


class ChatCompletionCreateApi(GenerationApi):
    kind = "chat"
    InputSerializer = ChatCompletionInputSerializer
    OutputSerializer = ChatCompletionSerializer
    Stream = ChatStream
    render_body = staticmethod(chat_completion_body)
    operation_id, summary = "createChatCompletion", "Create a chat completion"
