"""A corpus of JSON schemas for constrained (structured) decoding tests.

Every schema is bounded, so that *any* token sequence its grammar allows ends quickly: a random-weight
model decoding greedily under the grammar must finish within about 200 tokens with any tokenizer.
The rules, checked by tests/engine/test_structured_schemas.py:

- every object has ``"additionalProperties": false``;
- every array has ``maxItems`` of at most 4;
- every integer and number has a lower and an upper bound (xgrammar writes at most six fraction
  digits and no exponent for a bounded number; an unbounded one may run on forever);
- every string is an ``enum``, a ``const`` or a ``pattern`` with bounded repeats. A string bounded
  only by ``maxLength`` is not enough: xgrammar 0.2.8 lets such a string hold raw control characters
  (U+0000-U+001F but CR and LF), which is not JSON, and the text of special tokens such as
  ``<|begin_of_text|>``. Where ``minLength``/``maxLength`` appear, a pattern with the same bounds
  carries them (xgrammar ignores the length keywords beside a pattern);
- an optional group in a pattern is written ``{0,1}``, never ``?``: xgrammar 0.2.8 lets a string skip
  the leading literal of a ``(...)?`` group that holds a variable repeat (``^a(-c{1,2})?$`` accepts
  ``"ac"``);
- no keyword that xgrammar 0.2.8 ignores is relied on: ``uniqueItems``, ``contains``, ``allOf``,
  ``not``, ``if``/``then``, ``dependentRequired``, ``patternProperties`` and ``multipleOf`` on numbers.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _object(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def _integer(minimum: int, maximum: int) -> Schema:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _number(minimum: float, maximum: float) -> Schema:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def _string(pattern: str) -> Schema:
    return {"type": "string", "pattern": pattern}


def _array(items: Schema, max_items: int, min_items: int = 0) -> Schema:
    schema: Schema = {"type": "array", "items": items, "maxItems": max_items}
    if min_items:
        schema["minItems"] = min_items
    return schema


_BOOLEAN: Schema = {"type": "boolean"}
_WORD = _string(r"^[A-Za-z]{1,12}$")
_NAME = _string(r"^[A-Z][a-z]{1,9}( [A-Z][a-z]{1,9}){0,1}$")
_TEXT = _string(r"^[A-Za-z0-9 ,.]{0,24}$")
_DATE = _string(r"^\d{4}-\d{2}-\d{2}$")
_TIME = _string(r"^([01]\d|2[0-3]):[0-5]\d$")
_CODE = _string(r"^[A-Z]{3}-[0-9]{2}$")
_SKU = _string(r"^[A-Z]{2}[0-9]{4}$")
_EMAIL = _string(r"^[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)$")
_CURRENCY: Schema = {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]}

_FLAT: list[tuple[str, Schema]] = [
    (
        "flat_object_with_three_required_fields",
        _object({"name": _NAME, "age": _integer(0, 120), "active": _BOOLEAN}, ("name", "age", "active")),
    ),
    (
        "flat_object_with_only_optional_fields",
        _object({"nickname": _WORD, "score": _integer(0, 100), "verified": _BOOLEAN}),
    ),
    (
        "flat_object_mixing_required_and_optional_fields",
        _object(
            {"id": _integer(1, 9999), "label": _WORD, "note": _TEXT, "priority": _integer(1, 5)},
            ("id", "label"),
        ),
    ),
    ("object_with_a_single_boolean", _object({"ok": _BOOLEAN}, ("ok",))),
    ("object_with_no_properties", _object({})),
    (
        "object_with_keys_that_hold_a_space_and_an_accent",
        _object({"unit price": _integer(0, 999), "naïve": _BOOLEAN}, ("unit price", "naïve")),
    ),
]

_NESTED: list[tuple[str, Schema]] = [
    (
        "nested_two_levels_person_with_address",
        _object(
            {
                "name": _NAME,
                "address": _object(
                    {"street": _TEXT, "city": _WORD, "zip": _string(r"^\d{5}$")}, ("city", "zip")
                ),
            },
            ("name", "address"),
        ),
    ),
    (
        "nested_three_levels_server_config",
        _object(
            {
                "server": _object(
                    {
                        "port": _integer(1, 65535),
                        "tls": _object(
                            {"enabled": _BOOLEAN, "version": {"enum": ["1.2", "1.3"]}}, ("enabled",)
                        ),
                    },
                    ("port", "tls"),
                )
            },
            ("server",),
        ),
    ),
    (
        "nested_object_that_is_optional",
        _object({"title": _WORD, "meta": _object({"draft": _BOOLEAN, "rev": _integer(0, 99)})}, ("title",)),
    ),
    (
        "nested_three_levels_ending_in_a_const",
        _object({"o": _object({"p": _object({"q": {"const": True}}, ("q",))}, ("p",))}, ("o",)),
    ),
]

_ENUMS: list[tuple[str, Schema]] = [
    ("top_level_string_enum", {"type": "string", "enum": ["low", "medium", "high"]}),
    ("top_level_mixed_enum_of_scalars", {"enum": ["a", 1, True, None, 2.5]}),
    ("top_level_integer_enum", {"type": "integer", "enum": [1, 2, 3, 5, 8]}),
    ("string_enum_with_non_ascii_values", {"enum": ["café", "日本", "🎉"]}),
    ("enum_of_an_object_an_array_and_a_string", {"enum": [{"a": 1}, [1, 2], "x"]}),
    (
        "object_with_two_string_enums",
        _object(
            {
                "status": {"type": "string", "enum": ["open", "closed", "pending"]},
                "level": {"enum": ["debug", "info", "warn", "error"]},
            },
            ("status", "level"),
        ),
    ),
]

_ARRAYS: list[tuple[str, Schema]] = [
    ("array_of_up_to_four_booleans", _array(_BOOLEAN, 4)),
    ("array_of_two_to_four_integers", _array(_integer(0, 99), 4, min_items=2)),
    ("array_of_at_least_one_enum_value", _array({"enum": ["red", "green", "blue"]}, 3, min_items=1)),
    ("array_of_patterned_tags", _array(_string(r"^#[a-z]{1,8}$"), 4)),
    (
        "array_of_point_objects",
        _array(_object({"x": _integer(-9, 9), "y": _integer(-9, 9)}, ("x", "y")), 3, min_items=1),
    ),
    ("array_of_exactly_two_numbers", _array(_number(-180, 180), 2, min_items=2)),
    ("array_of_arrays_of_digits", _array(_array(_integer(0, 9), 2), 2)),
    (
        "tuple_of_integer_and_word_via_prefix_items",
        {
            "type": "array",
            "prefixItems": [_integer(0, 9), _WORD],
            "items": False,
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    (
        "top_level_array_of_key_value_objects",
        _array(_object({"key": _WORD, "value": _integer(0, 999)}, ("key", "value")), 3),
    ),
    ("array_that_must_stay_empty", _array(_BOOLEAN, 0)),
]

_INTEGERS: list[tuple[str, Schema]] = [
    ("top_level_integer_from_zero_to_ten", _integer(0, 10)),
    ("integer_with_a_negative_range", _integer(-273, -1)),
    ("integer_with_a_range_across_zero", _integer(-50, 50)),
    ("integer_with_exclusive_minimum", {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}),
    ("integer_with_exclusive_bounds", {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}),
    ("integer_with_a_wide_range", _integer(-1000, 1000000)),
    ("integer_multiple_of_seven", {"type": "integer", "minimum": -50, "maximum": 50, "multipleOf": 7}),
]

_NUMBERS: list[tuple[str, Schema]] = [
    ("number_in_the_unit_interval", _number(0, 1)),
    ("number_with_a_negative_fractional_range", _number(-3.5, -1.25)),
    ("number_with_exclusive_bounds", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("number_with_a_wide_range", _number(-1000000, 1000000)),
    (
        "object_of_latitude_and_longitude",
        _object({"lat": _number(-90, 90), "lon": _number(-180, 180)}, ("lat", "lon")),
    ),
]

_BOOLEANS_AND_NULLS: list[tuple[str, Schema]] = [
    ("top_level_boolean", _BOOLEAN),
    (
        "object_of_optional_feature_flags",
        _object({"beta": _BOOLEAN, "dark_mode": _BOOLEAN, "telemetry": _BOOLEAN, "sso": _BOOLEAN}),
    ),
    ("top_level_null", {"type": "null"}),
    ("nullable_string_by_type_list", {"type": ["string", "null"], "pattern": r"^[a-z]{1,6}$"}),
    ("nullable_integer_by_type_list", {"type": ["integer", "null"], "minimum": 0, "maximum": 500}),
    (
        "object_with_nullable_fields",
        _object(
            {
                "first_name": _NAME,
                "middle_name": {"anyOf": [_NAME, {"type": "null"}]},
                "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 120},
            },
            ("first_name", "middle_name", "age"),
        ),
    ),
]

_STRINGS: list[tuple[str, Schema]] = [
    ("string_with_letters_dash_digits_pattern", _CODE),
    ("string_with_date_pattern", _DATE),
    ("string_with_clock_time_pattern", _TIME),
    ("string_with_hex_color_pattern", _string(r"^#[0-9a-fA-F]{6}$")),
    (
        "string_with_semantic_version_pattern",
        _string(r"^(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})$"),
    ),
    ("string_with_email_like_pattern", _EMAIL),
    ("string_with_alternation_pattern", _string(r"^(red|green|blue)$")),
    ("string_with_phone_number_pattern", _string(r"^\+[1-9]\d{6,11}$")),
    (
        "string_with_min_and_max_length",
        {"type": "string", "minLength": 3, "maxLength": 8, "pattern": r"^[a-z]{3,8}$"},
    ),
    (
        "username_with_length_and_pattern",
        {"type": "string", "minLength": 2, "maxLength": 16, "pattern": r"^[a-z][a-z0-9_]{1,15}$"},
    ),
    ("top_level_const_string", {"const": "v1"}),
    ("top_level_const_null", {"const": None}),
    (
        "object_with_a_const_version_field",
        _object({"version": {"const": "2024-01"}, "payload": _integer(0, 9)}, ("version", "payload")),
    ),
]

_COMBINATIONS: list[tuple[str, Schema]] = [
    (
        "any_of_two_object_shapes",
        {
            "anyOf": [
                _object({"x": _integer(0, 3)}, ("x",)),
                _object({"y": _BOOLEAN, "z": _WORD}, ("y",)),
            ]
        },
    ),
    (
        "one_of_shapes_told_apart_by_a_kind_const",
        {
            "oneOf": [
                _object({"kind": {"const": "circle"}, "radius": _number(0, 100)}, ("kind", "radius")),
                _object(
                    {"kind": {"const": "rect"}, "w": _integer(1, 100), "h": _integer(1, 100)},
                    ("kind", "w", "h"),
                ),
            ]
        },
    ),
    (
        "any_of_integer_short_string_or_null",
        {"anyOf": [_integer(0, 5), _string(r"^[a-z]{2}$"), {"type": "null"}]},
    ),
    (
        "one_of_payment_methods",
        _object(
            {
                "amount": _integer(1, 100000),
                "method": {
                    "oneOf": [
                        _object({"type": {"const": "card"}, "last4": _string(r"^\d{4}$")}, ("type", "last4")),
                        _object(
                            {"type": {"const": "bank"}, "iban": _string(r"^[A-Z]{2}\d{2}[A-Z0-9]{8,12}$")},
                            ("type", "iban"),
                        ),
                    ]
                },
            },
            ("amount", "method"),
        ),
    ),
    (
        "defs_ref_used_twice",
        {
            "$defs": {"point": _object({"x": _integer(0, 9), "y": _integer(0, 9)}, ("x", "y"))},
            **_object(
                {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, ("start", "end")
            ),
        },
    ),
    (
        "defs_ref_to_a_ref",
        {"$defs": {"level": {"$ref": "#/$defs/small"}, "small": _integer(0, 3)}, "$ref": "#/$defs/level"},
    ),
    (
        "legacy_definitions_ref_in_array_items",
        {
            "definitions": {"color": _string(r"^#[0-9a-f]{6}$")},
            **_array({"$ref": "#/definitions/color"}, 3),
        },
    ),
    (
        "defs_ref_for_array_items_of_objects",
        {
            "$defs": {"tag": _object({"name": _WORD, "weight": _number(0, 1)}, ("name",))},
            **_object({"tags": _array({"$ref": "#/$defs/tag"}, 3)}, ("tags",)),
        },
    ),
]

_LINE_ITEM = _object(
    {"sku": _SKU, "quantity": _integer(1, 99), "unit_price": _number(0, 999)},
    ("sku", "quantity", "unit_price"),
)

_REALISTIC: list[tuple[str, Schema]] = [
    (
        "person",
        _object(
            {
                "name": _NAME,
                "age": _integer(0, 120),
                "email": _EMAIL,
                "languages": _array({"enum": ["en", "fr", "de", "ja"]}, 4),
            },
            ("name", "age"),
        ),
    ),
    (
        "order_with_line_items",
        _object(
            {
                "order_id": _CODE,
                "currency": _CURRENCY,
                "items": _array(_LINE_ITEM, 2, min_items=1),
                "paid": _BOOLEAN,
            },
            ("order_id", "currency", "items"),
        ),
    ),
    (
        "weather_report",
        _object(
            {
                "city": _WORD,
                "date": _DATE,
                "temperature_c": _number(-60, 60),
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
                "wind_kmh": _integer(0, 300),
                "alerts": _array(_WORD, 2),
            },
            ("city", "date", "temperature_c", "conditions"),
        ),
    ),
    (
        "calendar_event",
        _object(
            {
                "title": _TEXT,
                "date": _DATE,
                "start": _TIME,
                "end": _TIME,
                "all_day": _BOOLEAN,
                "attendees": _array(_EMAIL, 2),
            },
            ("title", "date"),
        ),
    ),
    (
        "product",
        _object(
            {
                "sku": _SKU,
                "name": _TEXT,
                "price": _object(
                    {"amount": _number(0, 100000), "currency": _CURRENCY}, ("amount", "currency")
                ),
                "in_stock": _BOOLEAN,
                "tags": _array(_WORD, 3),
            },
            ("sku", "name", "price"),
        ),
    ),
    (
        "tool_call_with_name_and_arguments",
        _object(
            {
                "name": {"const": "get_weather"},
                "arguments": _object({"city": _WORD, "unit": {"enum": ["celsius", "fahrenheit"]}}, ("city",)),
            },
            ("name", "arguments"),
        ),
    ),
    (
        "tool_call_choosing_between_tools",
        {
            "anyOf": [
                _object(
                    {
                        "name": {"const": "search"},
                        "arguments": _object({"query": _TEXT, "limit": _integer(1, 10)}, ("query",)),
                    },
                    ("name", "arguments"),
                ),
                _object(
                    {
                        "name": {"const": "send_email"},
                        "arguments": _object({"to": _EMAIL, "subject": _TEXT}, ("to", "subject")),
                    },
                    ("name", "arguments"),
                ),
            ]
        },
    ),
    (
        "api_error_response",
        _object(
            {
                "error": _object(
                    {
                        "code": _integer(400, 599),
                        "type": {"enum": ["invalid_request_error", "rate_limit_error", "server_error"]},
                        "message": _TEXT,
                        "param": {"anyOf": [_WORD, {"type": "null"}]},
                    },
                    ("code", "type", "message"),
                )
            },
            ("error",),
        ),
    ),
    (
        "sentiment_classification",
        _object(
            {"label": {"enum": ["positive", "neutral", "negative"]}, "confidence": _number(0, 1)},
            ("label", "confidence"),
        ),
    ),
    (
        "log_entry",
        _object(
            {
                "level": {"enum": ["debug", "info", "warn", "error"]},
                "time": _TIME,
                "service": _string(r"^[a-z]{2,10}(-[a-z]{2,8}){0,1}$"),
                "retries": _integer(0, 5),
            },
            ("level", "time", "service"),
        ),
    ),
]

SCHEMAS: list[tuple[str, Schema]] = [
    *_FLAT,
    *_NESTED,
    *_ENUMS,
    *_ARRAYS,
    *_INTEGERS,
    *_NUMBERS,
    *_BOOLEANS_AND_NULLS,
    *_STRINGS,
    *_COMBINATIONS,
    *_REALISTIC,
]


def schema_names() -> list[str]:
    return [name for name, _ in SCHEMAS]
