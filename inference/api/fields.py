"""Request fields with OpenAI's accepted shapes, and the list of fields the platform refuses."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from core.api.base import unknown_field_error
from engine.rules import (
    MAX_COMPLETION_PROMPTS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SERVICE_TIERS,
)
from engine.structured_output.spec import StructuredOutputsError, structured_outputs_check

# OpenAI fields this platform does not implement: a clear 400 naming the field beats silence.
UNSUPPORTED_FIELDS = frozenset(
    {
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "suffix",
    }
)
# vLLM's older names of structured_outputs' fields, removed there too.
RENAMED_FIELDS = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": "structured_outputs",
}
# Accepted and ignored: they change nothing about generation.
IGNORED_FIELDS: frozenset[str] = frozenset()
# OpenAI's bounds on metadata (kept only with store, which this server refuses; checked all the same).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class StopField(serializers.Field):
    """`stop`: a string or a list of up to four non-empty strings of bounded length (null: none)."""

    def to_internal_value(self, data: Any) -> list[str]:
        if data is None:
            return []
        if isinstance(data, str):
            data = [data]
        if not isinstance(data, list):
            raise serializers.ValidationError("stop must be a string or a list of strings.")
        if len(data) > MAX_STOP_STRINGS:
            raise serializers.ValidationError(f"stop takes at most {MAX_STOP_STRINGS} strings.")
        if not all(isinstance(s, str) and s for s in data):
            raise serializers.ValidationError("Each stop sequence must be a non-empty string.")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in data):
            raise serializers.ValidationError(
                f"Each stop sequence may be at most {MAX_STOP_STRING_CHARS} characters long."
            )
        return list(data)

    def to_representation(self, value: Any) -> Any:
        return value


class ModelField(serializers.CharField):
    """`model`: a name. DRF's CharField would take 5 as "5" and answer 404 for a wrong type."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PromptField(serializers.Field):
    """`prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists.

    Internal value: a list of prompts, each a str or a list[int].
    """

    def to_internal_value(self, data: Any) -> list[str | list[int]]:
        if isinstance(data, str):
            return [data]
        if (
            isinstance(data, list)
            and len(data) > MAX_COMPLETION_PROMPTS
            and not all(_is_int(t) for t in data)
        ):
            raise serializers.ValidationError(f"prompt takes at most {MAX_COMPLETION_PROMPTS} prompts.")
        if isinstance(data, list) and data:
            if all(isinstance(p, str) for p in data):
                return list(data)
            if all(_is_int(t) for t in data):
                return [list(data)]
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in data):
                return [list(p) for p in data]
        raise serializers.ValidationError(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists,"
            " and not empty."
        )

    def to_representation(self, value: Any) -> Any:
        return value


_ROLES = {"system", "developer", "user", "assistant", "tool"}


class MessagesField(serializers.Field):
    """`messages`: role + text content (a string or a list of text parts); assistant messages may
    carry `tool_calls` (then content may be null), `tool` messages a `tool_call_id`. Internal value:
    [{"role", "content": str, "tool_calls"?: [...], "tool_call_id"?: str}], with `developer` read
    as `system` (as OpenAI does for older models)."""

    def to_internal_value(self, data: Any) -> list[dict[str, Any]]:
        if not isinstance(data, list) or not data:
            raise serializers.ValidationError("messages must be a non-empty list.")
        out: list[dict[str, Any]] = []
        for i, message in enumerate(data):
            if not isinstance(message, dict):
                raise serializers.ValidationError(f"messages[{i}] must be an object.")
            role = message.get("role")
            if "function_call" in message:
                raise serializers.ValidationError(
                    f"messages[{i}].function_call is not supported; use tool_calls."
                )
            if role not in _ROLES:
                raise serializers.ValidationError(
                    f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}."
                )
            calls = message.get("tool_calls")
            if calls is not None and role != "assistant":
                raise serializers.ValidationError(f"messages[{i}]: only assistant messages have tool_calls.")
            item: dict[str, Any] = {"role": "system" if role == "developer" else role}
            if calls:
                item["tool_calls"] = _tool_calls(calls, i)
                item["content"] = "" if message.get("content") is None else _text(message, i)
            else:
                item["content"] = _text(message, i)
            if role == "tool":
                call_id = message.get("tool_call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise serializers.ValidationError(
                        f"messages[{i}].tool_call_id must be a non-empty string."
                    )
                item["tool_call_id"] = call_id
            out.append(item)
        return out

    def to_representation(self, value: Any) -> Any:
        return value


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise serializers.ValidationError(f"messages[{i}].tool_calls must be a list.")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str)
        ):
            raise serializers.ValidationError(
                f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}"
                " with arguments as a JSON string."
            )
        out.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": function.get("arguments") or "{}"},
            }
        )
    return out


def _text(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise serializers.ValidationError(f"messages[{i}].content: only text parts are supported.")
            parts.append(part["text"])
        return "".join(parts)
    raise serializers.ValidationError(f"messages[{i}].content must be a string or a list of text parts.")


class StreamOptionsSerializer(serializers.Serializer):
    include_usage = serializers.BooleanField(required=False, default=False)


class SamplingInputSerializer(serializers.Serializer):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model = ModelField(max_length=200)
    max_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=2.0)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    n = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=MAX_N)
    stop = StopField(required=False, allow_null=True)
    seed = serializers.IntegerField(required=False, allow_null=True)
    presence_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2.0, max_value=2.0)
    frequency_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2.0, max_value=2.0)
    stream = serializers.BooleanField(required=False, allow_null=True, default=False)
    stream_options = StreamOptionsSerializer(required=False, allow_null=True)
    # vLLM's extras.
    top_k = serializers.IntegerField(required=False, allow_null=True, min_value=-1)
    min_p = serializers.FloatField(required=False, allow_null=True, min_value=0.0, max_value=1.0)
    repetition_penalty = serializers.FloatField(required=False, allow_null=True, min_value=0.0)
    min_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    ignore_eos = serializers.BooleanField(required=False, allow_null=True)
    logit_bias = serializers.DictField(required=False, allow_null=True)
    # vLLM's extra: a grammar the output must match (json, regex, choice, grammar or json_object).
    structured_outputs = serializers.JSONField(required=False, allow_null=True)
    # vLLM's extra: logprobs of the prompt's tokens, with this many top entries each (0..20).
    prompt_logprobs = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=20)
    # The caller's identifiers, recorded in the usage ledger (safety_identifier and
    # prompt_cache_key replace `user` in the current SDKs).
    user = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    safety_identifier = serializers.CharField(
        required=False, allow_null=True, allow_blank=True, max_length=64
    )
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    metadata = serializers.DictField(
        child=serializers.CharField(allow_blank=True, max_length=MAX_METADATA_VALUE),
        required=False,
        allow_null=True,
    )
    store = serializers.BooleanField(required=False, allow_null=True)
    # OpenAI's processing tier; which ones a tenant may use is the operator's choice.
    service_tier = serializers.ChoiceField(choices=SERVICE_TIERS, required=False, allow_null=True)
    # Seconds the request may wait to start before it is dropped (also taken from the SDK's
    # x-stainless-read-timeout header and the tenant's default; the shortest applies).
    timeout = serializers.FloatField(required=False, allow_null=True, min_value=0.001, max_value=86_400)

    def validate_metadata(self, value: dict | None) -> dict | None:
        if value and (len(value) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY for k in value)):
            raise serializers.ValidationError(
                f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY} characters."
            )
        return value

    def validate_store(self, value: bool | None) -> bool | None:
        if value:
            raise serializers.ValidationError("store is not supported: completions are not stored.")
        return value

    def validate_top_p(self, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise serializers.ValidationError("top_p must be greater than 0.")
        return value

    def validate_repetition_penalty(self, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise serializers.ValidationError("repetition_penalty must be greater than 0.")
        return value

    def validate_logit_bias(self, value: dict | None) -> dict[int, float] | None:
        if not value:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise serializers.ValidationError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} token ids.")
        out: dict[int, float] = {}
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise serializers.ValidationError(f"logit_bias keys must be token ids, got {key!r}.")
            if (
                isinstance(bias, bool)
                or not isinstance(bias, int | float)
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
            ):
                raise serializers.ValidationError(
                    f"logit_bias values must be numbers from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}, got {bias!r}."
                )
            out[int(key)] = float(bias)
        return out

    def validate_structured_outputs(self, value: Any) -> dict | None:
        try:
            return structured_outputs_check(value)
        except StructuredOutputsError as exc:
            raise serializers.ValidationError(str(exc)) from exc

    def validate(self, attrs: dict) -> dict:
        if attrs.get("prompt_logprobs") is not None and attrs.get("stream"):
            raise serializers.ValidationError(
                {"prompt_logprobs": "prompt_logprobs is not supported with stream; ask without streaming."}
            )
        if attrs.get("stream_options") is not None and not attrs.get("stream"):
            raise serializers.ValidationError(
                {"stream_options": "stream_options is only allowed when stream is true."}
            )
        return attrs


def refuse_unsupported(body: dict, known: set[str]) -> None:
    """Raise a ValidationError naming the first field that is unsupported or unknown."""
    for name in body:
        if name in known or name in IGNORED_FIELDS:
            continue
        if name in UNSUPPORTED_FIELDS:
            raise serializers.ValidationError({name: f"{name} is not supported by this server."})
        if name in RENAMED_FIELDS:
            raise serializers.ValidationError({name: f"{name} is not supported; use {RENAMED_FIELDS[name]}."})
        raise unknown_field_error(name)
