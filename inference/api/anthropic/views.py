"""POST /v1/messages and /v1/messages/count_tokens, as Anthropic's API and SDK speak them: a key
as `x-api-key` (or a Bearer token), `anthropic-version` and `anthropic-beta` accepted (no beta
changes anything here), errors in Anthropic's shape. The body is read into a chat completion
body (inference.api.anthropic.translate), checked by the chat serializer and run by the one
generation service: the same limits, tiers, fair share and ledger as /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseBase
from drf_spectacular.utils import extend_schema

from core.api.base import json_body
from core.errors import InvalidRequestError
from inference import tokenization
from inference.api.anthropic import render, translate
from inference.api.anthropic.schema import (
    MESSAGE_EVENTS,
    MessageCountInputSerializer,
    MessageCreateInputSerializer,
    MessageSerializer,
    MessageTokensCountSerializer,
    anthropic_errors,
)
from inference.api.base import CountedRefusalsApi, generation_input
from inference.api.body_json import body_json
from inference.api.chat_completions.schema import ChatCompletionInputSerializer
from inference.services import collect_choices, served_model_resolve

# Chat fields named in a refusal, as the Messages API names them.
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


class AnthropicApi(CountedRefusalsApi):
    """A view of Anthropic's API: its error shape and its request-id header (every view takes the
    key as `x-api-key` too: core.api.base.ApiView.authorization)."""

    render_error = staticmethod(render.error_response)

    async def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        response = await super().dispatch(request, *args, **kwargs)
        response["request-id"] = self.request_id
        return response


def _chat_data(request: HttpRequest) -> dict[str, Any]:
    chat = translate.chat_body(json_body(request))
    try:
        data = generation_input(chat, ChatCompletionInputSerializer)
    except InvalidRequestError as exc:
        if exc.param in _PARAMS:
            exc.param = _PARAMS[exc.param]
        raise
    # Clients send a max_tokens sized for Anthropic's models (Claude Code: 32,000): a bound on the
    # answer, cut to the context the prompt leaves, the answer then ending with max_tokens.
    data["max_tokens_within_context"] = True
    return data


class MessageCreateApi(AnthropicApi):
    @extend_schema(
        operation_id="createMessage",
        summary="Create a message (Anthropic's Messages API)",
        request=MessageCreateInputSerializer,
        responses={
            (200, "application/json"): MessageSerializer,
            (200, "text/event-stream"): MESSAGE_EVENTS,
            **anthropic_errors(),
        },
    )
    async def post(self, request: HttpRequest) -> HttpResponse:
        generation, events, _ = await self.start_generation(request, kind="chat", read=_chat_data)
        plan = generation.plan
        if plan.stream:
            return render.message_stream_response(generation, events)
        choices = await collect_choices(events, count=1)
        body = render.message_body(plan, choices[0], generation.usage)
        return HttpResponse(body_json(body), content_type="application/json")


class MessageCountTokensApi(AnthropicApi):
    # Tokenizing grows with the body: in a thread of the pool, not on the shared one.
    handler_in_pool = True

    @extend_schema(
        operation_id="countMessageTokens",
        summary="Count the tokens of a message's prompt (Anthropic's Messages API)",
        request=MessageCountInputSerializer,
        responses={200: MessageTokensCountSerializer, **anthropic_errors()},
    )
    def post(self, request: HttpRequest) -> dict[str, Any]:
        fields = translate.count_tokens_body(json_body(request))
        data = generation_input({**fields, "max_completion_tokens": 1}, ChatCompletionInputSerializer)
        deployment = served_model_resolve(auth=self.auth, model=data["model"]).deployment
        choice = data.get("tool_choice") or "none"
        fits = tokenization.PromptFit(
            max_model_len=deployment.max_model_len, completion_tokens=1, what="messages", param="messages"
        )
        prompt = tokenization.chat_prompt_ids(
            deployment.model_path,
            data["messages"],
            tools=(data.get("tools") or None) if choice != "none" else None,
            fits=fits,
        )
        return {"input_tokens": len(prompt)}
