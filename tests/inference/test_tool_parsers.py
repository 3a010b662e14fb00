"""Tool calls out of generated text (inference/api/tool_calls.py): the model formats, whole and
streamed in any chunking, and the forced tool choice streams with their schemas."""

from __future__ import annotations

import random
import re

import jsonschema
import pytest

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
CASES = [pytest.param("hermes", text, id=f"hermes-{i}") for i, text in enumerate(HERMES_TEXTS)] + [
    pytest.param("llama3_json", text, id=f"llama3_json-{i}") for i, text in enumerate(LLAMA3_TEXTS)
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
        get_parser("mistral")

    assert str(raised.value) == "unknown tool call parser 'mistral'; known parsers: hermes, llama3_json"


def test_the_parsers_a_deployment_may_name_are_the_registrys():
    from inference.models import ModelDeployment
    from inference.tool_parsers import DEFAULT_PARSER, PARSERS

    field = ModelDeployment._meta.get_field("tool_call_parser")
    assert [name for name, _ in field.choices] == [*PARSERS, ""]
    assert field.default == DEFAULT_PARSER
    for name in PARSERS:
        assert get_parser(name).parse("plain text") == ("plain text", [])
