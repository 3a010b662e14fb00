"""The embeddings body (the parser's serializer) and the answer's shape (for the OpenAPI schema:
the view builds the bodies, which it must describe)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from core.api.base import StrictSerializer
from engine.rules import MAX_EMBEDDING_INPUTS as MAX_INPUTS
from inference.api.fields import ModelField, PromptField

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


@extend_schema_field(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_INPUTS},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_INPUTS},
        ]
    }
)
class EmbeddingInputField(PromptField):
    """`input`: a string, a list of strings, a list of token ids, or a list of token-id lists."""

    max_items = MAX_INPUTS
    noun = "input"


@extend_schema_serializer(component_name="CreateEmbedding")
class EmbeddingInputSerializer(StrictSerializer):
    """The body of POST /v1/embeddings: OpenAI's fields, and vLLM's truncate_prompt_tokens."""

    model = ModelField(max_length=200)
    input = EmbeddingInputField()
    encoding_format = serializers.ChoiceField(choices=["float", "base64"], required=False, default="float")
    dimensions = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        help_text="Cut the vectors to this many, then renormalize.",
    )
    user = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    truncate_prompt_tokens = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        help_text="vLLM's: keep at most this many tokens of each input (its special tokens kept).",
    )


@extend_schema_field({"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]})
class VectorField(serializers.JSONField):
    pass


class EmbeddingSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["embedding"])
    index = serializers.IntegerField(min_value=0)
    embedding = VectorField(
        help_text="Floats, or base64 of little-endian float32 with encoding_format base64."
    )


class EmbeddingUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField(min_value=0)
    total_tokens = serializers.IntegerField(min_value=0)


@extend_schema_serializer(component_name="CreateEmbeddingResponse")
class EmbeddingListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = EmbeddingSerializer(many=True)
    model = serializers.CharField()
    usage = EmbeddingUsageSerializer()
