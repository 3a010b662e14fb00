"""Request fields with OpenAI's accepted shapes, and the list of fields the platform refuses."""

from __future__ import annotations

import math
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api.base import StrictSerializer, unknown_field_error
from engine.rules import (
    MAX_COMPLETION_PROMPTS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SERVICE_TIERS,
)
from engine.sampling_params import (
    INTEGER_RANGES,
    MAX_TOKEN_ID_DIGITS,
    NUMBER_RANGES,
    SamplingParams,
    SamplingParamsError,
)
from engine.structured_output.spec import MAX_CHOICES, StructuredOutputsError, structured_outputs_check
from inference.services.plans import SAMPLING_PARAMS_FIELDS

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

_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}


@extend_schema_field(
    {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS}]}
)
class StopField(serializers.Field):
    """`stop`: a string or a list of up to four non-empty strings of bounded length (null: none);
    checked by the engine's SamplingParams, as every sampling parameter is."""

    def to_internal_value(self, data: Any) -> Any:
        return data

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


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


@extend_schema_field(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_COMPLETION_PROMPTS},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_COMPLETION_PROMPTS},
        ]
    }
)
class PromptField(serializers.Field):
    """`prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists.

    Internal value: a list of prompts, each a str or a list[int].
    """

    max_items = MAX_COMPLETION_PROMPTS
    noun = "prompt"

    def to_internal_value(self, data: Any) -> list[str | list[int]]:
        if isinstance(data, str):
            return [data]
        if isinstance(data, list) and len(data) > self.max_items and not all(_is_int(t) for t in data):
            raise serializers.ValidationError(
                f"{self.field_name} takes at most {self.max_items} {self.noun}s."
            )
        if isinstance(data, list) and data:
            if all(isinstance(p, str) for p in data):
                return list(data)
            if all(_is_int(t) for t in data):
                return [list(data)]
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in data):
                return [list(p) for p in data]
        raise serializers.ValidationError(
            f"{self.field_name} must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists, and not empty."
        )

    def to_representation(self, value: Any) -> Any:
        return value


class StreamOptionsSerializer(serializers.Serializer):
    include_usage = serializers.BooleanField(required=False, default=False)


@extend_schema_field(
    {
        "type": "object",
        "description": "Token ids (as strings) to the bias added to their logits.",
        "propertyNames": {"pattern": f"^[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}$"},
        "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
        "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
    }
)
class LogitBiasField(serializers.DictField):
    pass


@extend_schema_field(
    {
        "type": "object",
        "description": "vLLM's structured outputs: exactly one of json, regex, choice, grammar, json_object.",
        "properties": {
            "json": {"anyOf": [{"type": "object"}, {"type": "string"}]},
            "regex": {"type": "string", "minLength": 1},
            "choice": {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": MAX_CHOICES,
            },
            "grammar": {"type": "string", "minLength": 1},
            "json_object": {"const": True},
            "disable_any_whitespace": {"type": "boolean"},
        },
        "additionalProperties": False,
    }
)
class StructuredOutputsField(serializers.JSONField):
    pass


def sampling_number(name: str) -> serializers.FloatField:
    """An optional number of the engine's SamplingParams: its range is checked there (one
    validator), and the API's schema shows it from the same table."""
    low, high, low_open = NUMBER_RANGES[name]
    schema: dict[str, Any] = {"type": "number", ("exclusiveMinimum" if low_open else "minimum"): low}
    if math.isfinite(high):
        schema["maximum"] = high
    return _documented(serializers.FloatField, schema)(required=False, allow_null=True)


def sampling_integer(name: str) -> serializers.IntegerField:
    """An optional integer of the engine's SamplingParams (see sampling_number)."""
    low, high = INTEGER_RANGES[name]
    schema: dict[str, Any] = {"type": "integer"}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return _documented(serializers.IntegerField, schema)(required=False, allow_null=True)


def _documented(base: type[serializers.Field], schema: dict[str, Any]) -> Any:
    # A subclass, not the instance, carries the schema: serializers deep-copy their declared
    # fields by constructing them again, which would drop an instance's attributes.
    return extend_schema_field(schema)(type(base.__name__, (base,), {}))


def sampling_params_check(attrs: dict[str, Any]) -> None:
    """Build the engine's SamplingParams from the body's sampling fields (the one validator of
    them); its error is a 400 naming the field. Parsed values (stop as a list, logit_bias keyed by
    token id) replace the body's. min_tokens against max_tokens is checked once the plan knows
    max_tokens (it may depend on the prompt's length)."""
    given = {name: attrs[name] for name in SAMPLING_PARAMS_FIELDS if attrs.get(name) is not None}
    try:
        params = SamplingParams(**given, max_tokens=max(1, given.get("min_tokens") or 0))
    except SamplingParamsError as exc:
        raise serializers.ValidationError({exc.param: str(exc)}) from None
    if "stop" in attrs:
        attrs["stop"] = params.stop
    if "logit_bias" in attrs:
        attrs["logit_bias"] = params.logit_bias


@extend_schema_field({"type": "boolean", "enum": [False, None], "description": "Completions are not stored."})
class StoreField(serializers.BooleanField):
    pass


@extend_schema_field(
    {
        "type": "object",
        "maxProperties": MAX_METADATA_PAIRS,
        "propertyNames": {"maxLength": MAX_METADATA_KEY},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
    }
)
class MetadataField(serializers.DictField):
    pass


class SamplingInputSerializer(StrictSerializer):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras). Unknown and
    unsupported fields are refused first, by `refuse_unsupported`, with an error naming them."""

    model = ModelField(max_length=200)
    max_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    # The sampling parameters: their ranges are the engine's (sampling_params_check).
    temperature = sampling_number("temperature")
    top_p = sampling_number("top_p")
    n = sampling_integer("n")
    stop = StopField(required=False, allow_null=True)
    seed = sampling_integer("seed")
    presence_penalty = sampling_number("presence_penalty")
    frequency_penalty = sampling_number("frequency_penalty")
    stream = serializers.BooleanField(required=False, allow_null=True, default=False)
    stream_options = StreamOptionsSerializer(required=False, allow_null=True)
    # vLLM's extras.
    top_k = sampling_integer("top_k")
    min_p = sampling_number("min_p")
    repetition_penalty = sampling_number("repetition_penalty")
    min_tokens = sampling_integer("min_tokens")
    ignore_eos = serializers.BooleanField(required=False, allow_null=True)
    logit_bias = LogitBiasField(required=False, allow_null=True)
    # vLLM's extra: a grammar the output must match (json, regex, choice, grammar or json_object).
    structured_outputs = StructuredOutputsField(required=False, allow_null=True)
    # vLLM's extra: logprobs of the prompt's tokens, with this many top entries each (0..20).
    prompt_logprobs = sampling_integer("prompt_logprobs")
    # The caller's identifiers, recorded in the usage ledger (safety_identifier and
    # prompt_cache_key replace `user` in the current SDKs).
    user = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    safety_identifier = serializers.CharField(
        required=False, allow_null=True, allow_blank=True, max_length=64
    )
    prompt_cache_key = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    metadata = MetadataField(
        child=serializers.CharField(allow_blank=True, max_length=MAX_METADATA_VALUE),
        required=False,
        allow_null=True,
    )
    store = StoreField(required=False, allow_null=True)
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

    def validate_structured_outputs(self, value: Any) -> dict | None:
        try:
            return structured_outputs_check(value)
        except StructuredOutputsError as exc:
            raise serializers.ValidationError(str(exc)) from exc

    def validate(self, attrs: dict) -> dict:
        sampling_params_check(attrs)
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
