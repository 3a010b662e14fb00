"""Reasoning parsers (inference.reasoning): the thinking read apart from the answer, whole and
streamed, the stream's pieces always joining to the whole answer's parts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.reasoning import PARSERS, ReasoningStream, split


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "It is 4."),
        ("qwen3", "It is 4.", None, "It is 4."),  # thinking off: all content, as written
        ("qwen3", "  \nIt is 4.", None, "  \nIt is 4."),
        (
            "qwen3",
            "<think>still thinking when max_tokens cut it",
            "still thinking when max_tokens cut it",
            None,
        ),
        ("qwen3", "<think></think>\n\nIt is 4.", "", "It is 4."),
        ("qwen3", "<think>a</think>", "a", None),
        ("qwen3", "The tag <think> later is text.", None, "The tag <think> later is text."),
        ("qwen3", "<thin", None, "<thin"),
        ("deepseek_r1", "Let me add.\n</think>\n\nIt is 4.", "Let me add.\n", "It is 4."),
        ("deepseek_r1", "<think>Let me add.</think>It is 4.", "Let me add.", "It is 4."),
        ("deepseek_r1", "cut short", "cut short", None),
        ("deepseek_r1", "", "", None),
        ("qwen3", "", None, None),
        ("qwen3", "<think>x</thi", "x</thi", None),  # a partial closing tag at the end is text
    ],
)
def test_a_whole_answer_is_split_into_reasoning_and_content(parser, text, reasoning, content):
    assert split(parser, text) == (reasoning, content)


def test_the_stream_holds_back_what_may_be_a_tag_and_never_sends_empty_pieces():
    stream = ReasoningStream("qwen3")
    assert stream.feed("<th") == []
    assert stream.feed("ink>I") == [("reasoning", "I")]
    assert stream.feed(" add</th") == [("reasoning", " add")]
    assert stream.feed("ink>\n") == []
    assert stream.feed("\nFour") == [("content", "Four")]
    assert stream.finish() == []


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose from qwen3, deepseek_r1"):
        ReasoningStream("r2")


_pieces = st.lists(
    st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think>", "\n", " ", "a", "b c", "<"])
)


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(sorted(PARSERS)), parts=_pieces, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_streamed_pieces_join_to_the_whole_answers_parts_however_the_text_is_cut(parser, parts, cuts):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    stream = ReasoningStream(parser)
    pieces = [p for chunk in chunks for p in stream.feed(chunk)] + stream.finish()
    assert all(piece for _, piece in pieces)
    reasoning, content = split(parser, text)
    assert "".join(t for kind, t in pieces if kind == "reasoning") == (reasoning or "")
    assert "".join(t for kind, t in pieces if kind == "content") == (content or "")
