"""Tool calls out of generated text (inference/tool_parsers/): the model formats, whole and
streamed in any chunking, the forced tool choice streams with their schemas, and the parsers a
deployment names reading a chat completion's output."""

from __future__ import annotations

import asyncio
import random
import re

import jsonschema
import pytest
from asgiref.sync import sync_to_async

from engine.protocol import DeltaOutput, Event, FinishedOutput, Usage
from inference.tool_parsers import (
    ContentDelta,
    NamedToolStream,
    RequiredToolStream,
    ToolCall,
    ToolCallDelta,
    get_parser,
    named_tool_schema,
    parse_named,
    parse_required,
    required_tools_schema,
)
from tests.helpers import api_post

ID = re.compile(r"call_[A-Za-z0-9]{24}")


def hermes_tag(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = hermes_tag('{"name": "get_weather", "arguments": {"city": "Paris"}}')
TIME = hermes_tag('{"name": "get_time", "arguments": {"zone": "CET", "24h": true}}')


def named(calls: list[ToolCall]) -> list[tuple[str, str]]:
    assert all(ID.fullmatch(call.id) for call in calls)
    return [(call.name, call.arguments) for call in calls]


def stream_all(stream, pieces: list[str]) -> list[ContentDelta | ToolCallDelta]:
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    return deltas + stream.finish()


def assemble(deltas: list[ContentDelta | ToolCallDelta]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call as a client accumulates a stream's chunks."""
    content = ""
    calls: list[list[str]] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content += delta.text
        elif delta.index == len(calls):
            assert ID.fullmatch(delta.id) and delta.name
            calls.append([delta.name, delta.arguments])
        else:
            assert delta.index == len(calls) - 1 and delta.id is None and delta.name is None
            calls[delta.index][1] += delta.arguments
    return content, [(name, arguments) for name, arguments in calls]


# hermes


def test_hermes_text_without_calls_is_all_content():
    text = "  Hello, <b>world</b> and a < b.\n"

    assert get_parser("hermes").parse(text) == (text, [])


def test_hermes_one_call_has_no_content():
    content, calls = get_parser("hermes").parse(WEATHER)

    assert content is None
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_hermes_two_calls_with_text_around_keep_the_text_as_content():
    text = f"Let me check.\n{WEATHER}\nand the time:\n{TIME}\n"

    content, calls = get_parser("hermes").parse(text)

    assert content == "Let me check.\n\nand the time:"
    assert named(calls) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"zone": "CET", "24h": true}'),
    ]


def test_hermes_calls_get_distinct_ids():
    _, calls = get_parser("hermes").parse(WEATHER + TIME)

    assert calls[0].id != calls[1].id


def test_hermes_arguments_as_a_json_string_become_the_object():
    text = hermes_tag('{"name": "get_weather", "arguments": "{\\"city\\":\\"Paris\\"}"}')

    _, calls = get_parser("hermes").parse(text)

    assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_hermes_missing_arguments_are_an_empty_object():
    _, calls = get_parser("hermes").parse(hermes_tag('{"name": "now"}'))

    assert named(calls) == [("now", "{}")]


def test_hermes_unicode_arguments_stay_unescaped():
    text = hermes_tag('{"name": "w", "arguments": {"city": "Zürich", "note": "\\u96ea ❄"}}')

    _, calls = get_parser("hermes").parse(text)

    assert named(calls) == [("w", '{"city": "Zürich", "note": "雪 ❄"}')]


@pytest.mark.parametrize(
    "body",
    [
        "{not json}",
        '{"arguments": {"x": 1}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not an object"}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '["f"]',
    ],
)
def test_hermes_tag_that_is_no_call_stays_content(body):
    text = f"Before {hermes_tag(body)} after"

    assert get_parser("hermes").parse(text) == (text, [])


def test_hermes_invalid_tag_beside_a_valid_call_stays_in_the_content():
    bad = hermes_tag("{oops}")

    content, calls = get_parser("hermes").parse(f"{bad}\n{WEATHER}")

    assert content == bad
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_hermes_unclosed_final_tag_is_a_call_when_its_body_is_one():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'

    content, calls = get_parser("hermes").parse(text)

    assert content == "Sure."
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_hermes_unclosed_final_tag_cut_mid_body_is_content():
    text = f'{WEATHER}\n<tool_call>\n{{"name": "get_time", "argu'

    content, calls = get_parser("hermes").parse(text)

    assert content == '<tool_call>\n{"name": "get_time", "argu'
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_hermes_stream_passes_a_less_than_sign_through():
    stream = get_parser("hermes").stream()

    assert stream.feed("if a <") == [ContentDelta("if a")]
    assert stream.feed(" b then") == [ContentDelta(" < b then")]
    assert stream.finish() == []
    assert stream.called is False


def test_hermes_stream_holds_a_possible_tag_start_until_it_is_resolved():
    stream = get_parser("hermes").stream()

    assert stream.feed("x <tool_c") == [ContentDelta("x")]
    assert stream.feed("ar> y") == [ContentDelta(" <tool_car> y")]


def test_hermes_stream_emits_each_call_whole_when_its_tag_closes():
    stream = get_parser("hermes").stream()

    assert stream.feed("Checking.\n<tool_call>\n") == [ContentDelta("Checking.")]
    assert stream.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool') == []
    [delta] = stream.feed("_call>\n")
    assert (delta.index, delta.name, delta.arguments) == (0, "get_weather", '{"city": "Paris"}')
    assert ID.fullmatch(delta.id)
    assert stream.called is True
    [delta] = stream.feed(TIME)
    assert (delta.index, delta.name) == (1, "get_time")
    assert stream.finish() == []


def test_hermes_stream_holds_whitespace_around_calls_until_content_follows():
    stream = get_parser("hermes").stream()

    deltas = stream_all(stream, ["\nHi", WEATHER, "\n\n", TIME, "\n", "Done.\n", WEATHER, "\n"])

    assert [d.text for d in deltas if isinstance(d, ContentDelta)] == ["Hi", "\n\n\nDone."]


# llama3_json


def test_llama3_single_call():
    content, calls = get_parser("llama3_json").parse(
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )

    assert content is None
    assert named(calls) == [("get_weather", '{"city": "Oslo"}')]


def test_llama3_calls_separated_by_semicolons():
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": ";"}};\n'

    content, calls = get_parser("llama3_json").parse(text)

    assert content is None
    assert named(calls) == [("a", '{"x": 1}'), ("b", '{"y": ";"}')]


def test_llama3_python_tag_prefix_and_leading_whitespace_are_skipped():
    text = '\n <|python_tag|>{"name": "search", "parameters": {"q": "llamas"}}'

    content, calls = get_parser("llama3_json").parse(text)

    assert content is None
    assert named(calls) == [("search", '{"q": "llamas"}')]


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Oslo is mild.",
        '{"answer": 42}',
        '{"name": "a", "parameters": {}} and some words',
        '{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}',
        '<|python_tag|>brave_search.call(query="x")',
        '{"name": "a", "parameters": {"x": ',
        "",
    ],
)
def test_llama3_text_that_is_not_calls_is_all_content(text):
    assert get_parser("llama3_json").parse(text) == (text, [])


def test_llama3_stream_of_plain_text_is_not_held_back():
    stream = get_parser("llama3_json").stream()

    assert stream.feed("  ") == []
    assert stream.feed("The ") == [ContentDelta("The")]
    assert stream.feed("answer {is} 4.") == [ContentDelta(" answer {is} 4.")]
    assert stream.finish() == []


def test_llama3_stream_buffers_json_and_a_python_tag_prefix_until_the_end():
    stream = get_parser("llama3_json").stream()

    assert stream.feed("<|pyth") == []
    assert stream.feed('on_tag|>{"name": "f", ') == []
    assert stream.feed('"parameters": {"x": 1}}') == []
    [delta] = stream.finish()
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"x": 1}')
    assert stream.called is True


# mistral

MISTRAL_ARRAY = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"zone": "CET", "24h": true}}]'
)
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET", "24h": true}'
)
BOTH_CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET", "24h": true}')]


def test_mistral_text_without_the_marker_is_all_content():
    text = "  A [list], {braces} and TOOL_CALLS [TOOL_CALL].\n"

    assert get_parser("mistral").parse(text) == (text, [])


def test_mistral_json_array_after_the_marker_is_the_calls_and_the_text_before_is_content():
    content, calls = get_parser("mistral").parse(f"Let me check.\n{MISTRAL_ARRAY}")

    assert content == "Let me check."
    assert named(calls) == BOTH_CALLS
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text",
    [
        MISTRAL_V11,
        MISTRAL_V11.replace("[ARGS]", ""),
        '[TOOL_CALLS] get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}\n'
        '[TOOL_CALLS]get_time [ARGS] {"zone": "CET", "24h": true}',
    ],
    ids=["args-token", "no-args-token", "call-id-and-spaces"],
)
def test_mistral_v11_calls_are_a_name_and_arguments_after_each_marker(text):
    content, calls = get_parser("mistral").parse(text)

    assert content is None
    assert named(calls) == BOTH_CALLS


def test_mistral_text_after_the_calls_stays_content():
    content, calls = get_parser("mistral").parse(f"{MISTRAL_ARRAY}\nextra trailing data")

    assert content == "extra trailing data"
    assert named(calls) == BOTH_CALLS


def test_mistral_one_object_missing_or_string_arguments_are_read_as_hermes_reads_them():
    parser = get_parser("mistral")

    assert named(parser.parse('[TOOL_CALLS] {"name": "now"}')[1]) == [("now", "{}")]
    assert named(parser.parse('[TOOL_CALLS]w{"city": "Zürich"}')[1]) == [("w", '{"city": "Zürich"}')]
    assert named(parser.parse('[TOOL_CALLS][{"name": "w", "arguments": "{\\"x\\": 1}"}]')[1]) == [
        ("w", '{"x": 1}')
    ]


@pytest.mark.parametrize(
    "body",
    [
        "[TOOL_CALLS]",
        "[TOOL_CALLS] not json at all",
        "[TOOL_CALLS] []",
        '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}',
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"arguments": {}}]',
        '[TOOL_CALLS] [{"name": "f", "arguments": [1]}]',
        '[TOOL_CALLS] ["f"]',
        '[TOOL_CALLS]f[ARGS]{"x": NaN}',
        '[TOOL_CALLS]f[ARGS]"not an object"',
        '[TOOL_CALLS]two words{"x": 1}',
        '[TOOL_CALLS]f[ARGS]{"x": ',
    ],
)
def test_mistral_marker_with_no_call_after_it_stays_content(body):
    text = f"Before {body}"

    assert get_parser("mistral").parse(text) == (text, [])


def test_mistral_marker_with_no_call_beside_a_valid_call_stays_in_the_content():
    content, calls = get_parser("mistral").parse(
        '[TOOL_CALLS]f{oops}[TOOL_CALLS]get_weather{"city": "Paris"}'
    )

    assert content == "[TOOL_CALLS]f{oops}"
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]


def test_mistral_stream_holds_a_possible_marker_start_until_it_is_resolved():
    stream = get_parser("mistral").stream()

    assert stream.feed("x [TOOL_") == [ContentDelta("x")]
    assert stream.feed("CALLER] y") == [ContentDelta(" [TOOL_CALLER] y")]
    assert stream.finish() == []
    assert stream.called is False


def test_mistral_stream_emits_each_call_when_its_arguments_close():
    stream = get_parser("mistral").stream()

    assert stream.feed("Checking.[TOOL_") == [ContentDelta("Checking.")]
    assert stream.feed('CALLS]get_weather[ARGS]{"city": "Pa') == []
    [delta] = stream.feed('ris"}[TOOL')
    assert (delta.index, delta.name, delta.arguments) == (0, "get_weather", '{"city": "Paris"}')
    assert ID.fullmatch(delta.id)
    assert stream.called is True
    [delta] = stream.feed('_CALLS]get_time{"zone": "CET"}')
    assert (delta.index, delta.name, delta.arguments) == (1, "get_time", '{"zone": "CET"}')
    assert stream.finish() == []


def test_mistral_stream_sends_the_text_after_an_array_as_it_comes():
    stream = get_parser("mistral").stream()

    assert stream.feed('[TOOL_CALLS] [{"name": "f", "arguments": {"s": "]"}}') == []
    [delta] = stream.feed("]")
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"s": "]"}')
    assert stream.feed("\nDone") == [ContentDelta("Done")]
    assert stream.finish() == []


# phi4_mini_json

PHI4 = (
    'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {"zone": "CET", "24h": true}}]'
)


def test_phi4_mini_calls_follow_functools_and_the_text_before_is_content():
    content, calls = get_parser("phi4_mini_json").parse(f"Let me check. {PHI4}")

    assert content == "Let me check."
    assert named(calls) == BOTH_CALLS


def test_phi4_mini_calls_alone_have_no_content():
    content, calls = get_parser("phi4_mini_json").parse(PHI4)

    assert content is None
    assert named(calls) == BOTH_CALLS


def test_phi4_mini_functools_as_a_word_is_content_held_only_while_it_may_be_the_marker():
    stream = get_parser("phi4_mini_json").stream()

    assert stream.feed("Use functools") == [ContentDelta("Use")]
    assert stream.feed(".partial(f) or functools [x].") == [
        ContentDelta(" functools.partial(f) or functools [x].")
    ]
    assert stream.finish() == []
    assert stream.called is False


@pytest.mark.parametrize(
    "body",
    [
        "functools[",
        "functools[oops]",
        "functools[]",
        'functools[{"name": "f", "arguments": {}}',
        'functools[{"arguments": {}}]',
        'functools[{"name": "f", "arguments": "x"}]',
        'functools[{"name": "f", "arguments": {}}, 3]',
    ],
)
def test_phi4_mini_functools_with_no_calls_after_it_stays_content(body):
    text = f"Before {body} after"

    assert get_parser("phi4_mini_json").parse(text) == (text, [])


# streaming and non-streaming agree over any chunking

HERMES_TEXTS = [
    "Just text, with a < b and <tool and </tool_call> in it.",
    WEATHER,
    f"  Let me check.\n{WEATHER}\nthen\n{TIME}\n\n",
    hermes_tag('{"name": "w", "arguments": "{\\"city\\": \\"Zürich\\"}"}') + " 雪",
    f"<<tool_call>x</tool_call>{WEATHER}<tool_call",
    f'{WEATHER}<tool_call>\n{{"name": "now"}}\n',
    f'{WEATHER}<tool_call>\n{{"name": "now", "argu',
    "<tool_call><tool_call>" + WEATHER,
]
LLAMA3_TEXTS = [
    "Plain answer, no calls.",
    ' {"name": "f", "parameters": {"a": "<|python_tag|>;"}}',
    '<|python_tag|>{"name": "f", "parameters": {}};{"name": "g", "arguments": {"b": [1, 2]}}',
    '{"name": "f", "parameters": {}} trailing words',
    "<|python",
    "   ",
]
MISTRAL_TEXTS = [
    "Plain text with [brackets], {braces} and [TOOL_CALL in it.",
    f"  Let me check.\n{MISTRAL_ARRAY}\n",
    f"Let me check.{MISTRAL_V11}",
    MISTRAL_V11.replace("[ARGS]", "") + " done",
    '[TOOL_CALLS]f{oops}[TOOL_CALLS]w{"city": "Zürich"}[TOOL_CALLS',
    '[TOOL_CALLS] [{"name": "f", "arguments": {"s": "a]}"}}] and [TOOL_CALLS]g{"x": [1, {"y": 2}]}',
    "Hi [TOOL_CALLS] nothing",
    '[TOOL_CALLS]get_weather{"city": "Pa',
]
PHI4_TEXTS = [
    "Use functools.partial, or functools [sic].",
    f"  Let me check.\n{PHI4}\n",
    f"{PHI4}\nfunctools[oops] end",
    'functools[{"name": "f", "arguments": {"s": "]"}}',
]
CORPORA = {
    "hermes": HERMES_TEXTS,
    "llama3_json": LLAMA3_TEXTS,
    "mistral": MISTRAL_TEXTS,
    "phi4_mini_json": PHI4_TEXTS,
}
CASES = [
    pytest.param(name, text, id=f"{name}-{i}")
    for name, texts in CORPORA.items()
    for i, text in enumerate(texts)
]


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    singles = [list(text)]
    randoms = []
    for _ in range(40):
        cuts = (
            sorted(rng.sample(range(1, len(text)), k=rng.randint(0, len(text) - 1))) if len(text) > 1 else []
        )
        bounds = [0, *cuts, len(text)]
        randoms.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return splits + singles + randoms


@pytest.mark.parametrize(("parser_name", "text"), CASES)
def test_stream_in_any_chunking_gives_the_parsed_content_and_calls(parser_name, text):
    parser = get_parser(parser_name)
    content, calls = parser.parse(text)
    expected_content = (content or "") if calls else text.strip()

    for pieces in chunkings(text, random.Random(f"{parser_name}:{text}")):
        stream = parser.stream()
        streamed_content, streamed_calls = assemble(stream_all(stream, pieces))

        assert streamed_content == expected_content, pieces
        assert streamed_calls == named(calls), pieces
        assert stream.called is bool(calls)


def test_hermes_corpus_covers_calls_and_content():
    parsed = [get_parser("hermes").parse(text) for text in HERMES_TEXTS]

    assert [len(calls) for _, calls in parsed] == [0, 1, 2, 1, 1, 2, 1, 0]
    assert parsed[4][0] == "<<tool_call>x</tool_call><tool_call"


def test_mistral_and_phi4_mini_corpora_cover_calls_and_content():
    mistral = [get_parser("mistral").parse(text) for text in MISTRAL_TEXTS]
    phi4 = [get_parser("phi4_mini_json").parse(text) for text in PHI4_TEXTS]

    assert [len(calls) for _, calls in mistral] == [0, 2, 2, 2, 1, 2, 0, 0]
    assert [content for content, _ in mistral[1:6]] == [
        "Let me check.",
        "Let me check.",
        "done",
        "[TOOL_CALLS]f{oops}[TOOL_CALLS",
        "and",
    ]
    assert [len(calls) for _, calls in phi4] == [0, 2, 2, 0]
    assert phi4[2][0] == "functools[oops] end"


# forced tool choice

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW_TOOL = {"type": "function", "function": {"name": "now"}}


def test_named_tool_schema_is_the_function_parameters():
    assert named_tool_schema(WEATHER_TOOL) == WEATHER_TOOL["function"]["parameters"]
    assert named_tool_schema(NOW_TOOL) == {"type": "object", "properties": {}}


def test_required_tools_schema_pairs_each_name_with_its_parameters():
    schema = required_tools_schema([WEATHER_TOOL, NOW_TOOL], parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)

    assert validator.is_valid(
        [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]
    )
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {}}])
    assert not validator.is_valid([{"name": "now", "parameters": {}, "id": "x"}])
    assert not validator.is_valid([{"name": "now"}])
    assert not validator.is_valid([{"name": "other", "parameters": {}}])
    assert not validator.is_valid({"name": "now", "parameters": {}})


def test_required_tools_schema_allows_one_call_unless_parallel():
    schema = required_tools_schema([WEATHER_TOOL, NOW_TOOL], parallel=False)
    validator = jsonschema.Draft202012Validator(schema)

    assert schema["maxItems"] == 1
    assert validator.is_valid([{"name": "now", "parameters": {}}])
    assert not validator.is_valid([{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}])


def test_named_stream_sends_the_output_as_the_arguments():
    stream = NamedToolStream("get_weather")

    [first] = stream.feed('{"ci')
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"ci')
    assert ID.fullmatch(first.id)
    assert stream.feed('ty": "Paris"}') == [ToolCallDelta(0, None, None, 'ty": "Paris"}')]
    assert stream.feed("") == []
    assert stream.finish() == []
    assert stream.called is True


def test_named_stream_starts_the_call_on_an_empty_first_piece_and_on_an_empty_output():
    stream = NamedToolStream("now")
    [first] = stream.feed("")
    assert (first.name, first.arguments) == ("now", "")

    empty = NamedToolStream("now")
    assert empty.called is False
    [only] = empty.finish()
    assert (only.index, only.name, only.arguments) == (0, "now", "")
    assert empty.called is True


def test_parse_named_normalises_the_arguments_json():
    assert named(parse_named("get_weather", '{"city":"Zürich" }')) == [("get_weather", '{"city": "Zürich"}')]
    assert named(parse_named("get_weather", '{"city": "Zü')) == [("get_weather", '{"city": "Zü')]


REQUIRED_OUTPUT = (
    '[{"name": "get_weather", "parameters": {"city": "Pa]r}is \\"[{\\\\"}}, '
    '{"name": "now", "parameters": {}}]'
)


def test_parse_required_gives_each_element_as_a_call():
    assert named(parse_required(REQUIRED_OUTPUT)) == [
        ("get_weather", '{"city": "Pa]r}is \\"[{\\\\"}'),
        ("now", "{}"),
    ]


def test_parse_required_recovers_the_complete_elements_of_a_cut_output():
    cut = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "param'

    assert named(parse_required(cut)) == [("get_weather", '{"city": "Paris"}')]


def test_required_stream_emits_a_call_as_soon_as_its_element_closes():
    stream = RequiredToolStream()

    assert stream.feed('[{"name": "get_weather", "parameters": {"city": "Pa') == []
    [delta] = stream.feed('ris"}}, {"name": "no')
    assert (delta.index, delta.name, delta.arguments) == (0, "get_weather", '{"city": "Paris"}')
    assert stream.called is True
    assert stream.feed('w", "param') == []
    assert stream.finish() == []


def test_required_stream_in_any_chunking_matches_parse_required():
    expected = named(parse_required(REQUIRED_OUTPUT))

    for pieces in chunkings(REQUIRED_OUTPUT, random.Random(7)):
        stream = RequiredToolStream()
        content, calls = assemble(stream_all(stream, pieces))

        assert (content, calls) == ("", expected), pieces


def test_get_parser_with_an_unknown_name_names_the_known_parsers():
    with pytest.raises(ValueError) as raised:
        get_parser("pythonic")

    assert str(raised.value) == (
        "unknown tool call parser 'pythonic'; known parsers: hermes, llama3_json, mistral, phi4_mini_json"
    )


def test_the_parsers_a_deployment_may_name_are_the_registrys():
    from inference.models import ModelDeployment
    from inference.tool_parsers import DEFAULT_PARSER, PARSERS

    field = ModelDeployment._meta.get_field("tool_call_parser")
    assert [name for name, _ in field.choices] == [*PARSERS, ""]
    assert field.default == DEFAULT_PARSER
    for name in PARSERS:
        assert get_parser(name).parse("plain text") == ("plain text", [])


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["mistral", "phi4_mini_json"])
def test_a_deployment_may_name_the_mistral_and_phi4_mini_parsers_as_the_admin_offers_them(name):
    from django.core.exceptions import ValidationError

    from inference.admin import ModelDeploymentForm
    from inference.models import ModelDeployment
    from inference.tool_parsers import PARSERS

    field = ModelDeployment._meta.get_field("tool_call_parser")
    deployment = ModelDeployment.objects.create(
        name="m", model_path="/models/m", max_model_len=256, tool_call_parser=name
    )

    assert field.clean(name, deployment) == name
    assert ModelDeployment.objects.get(name="m").tool_call_parser == name
    assert (name, PARSERS[name][1]) in ModelDeploymentForm().fields["tool_call_parser"].choices
    with pytest.raises(ValidationError):
        field.clean("pythonic", deployment)


@pytest.mark.django_db(transaction=True)
# Room for the tools, which the tiny model's template (one that knows none) gets described in text.
@pytest.mark.world(deployment={"max_model_len": 1024})
@pytest.mark.parametrize(
    ("parser_name", "output", "keeps_special_tokens"),
    [
        ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', True),
        (
            "phi4_mini_json",
            'Checking. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            False,
        ),
    ],
)
async def test_a_deployments_parser_reads_the_calls_of_a_chat_completion(
    world, parser_name, output, keeps_special_tokens
):
    world.deployment.tool_call_parser = parser_name
    await sync_to_async(world.deployment.save)()
    await world.faults.heartbeat()

    async def answer():
        request = await world.faults.next_request()
        await world.faults.emit(request.request_id, Event.delta([DeltaOutput(0, output, [5, 6, 7])]))
        usage = Usage(len(request.prompt_token_ids), 3)
        await world.faults.emit(request.request_id, Event.finished([FinishedOutput(0, "stop")], usage))
        return request

    answering = asyncio.create_task(answer())
    response = await api_post(
        world,
        "/v1/chat/completions",
        {
            "model": world.model,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "max_tokens": 8,
        },
    )
    assert response.status_code == 200, response.content
    request = await answering

    # [TOOL_CALLS] is a special token: the engine's detokenizer drops it unless told to keep them.
    assert request.sampling_params.get("skip_special_tokens") is (False if keeps_special_tokens else None)
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert ID.fullmatch(call["id"])
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city": "Paris"}')
