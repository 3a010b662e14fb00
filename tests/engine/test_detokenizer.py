from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer, decode
from engine.sampling_params import SamplingParams
from engine.stop_checker import OutputStream, StopChecker, check_stop

CORPUS = [
    "The quick brown fox jumps over the lazy dog. ### END ###",
    "Café crème brûlée, naïve façade, jalapeño, Ångström, Zürich.",
    "我们今天去北京看长城。你好，世界！中文文本测试。",
    "日本語のテキストです。こんにちは世界。",
    "Emoji: 😀🎉🚀👍🏽 and 👨‍👩‍👧 family.",
    "Привет, мир! Ελληνικά γράμματα. مرحبا بالعالم",
]
SAMPLES = [
    "The lazy fox, naïve and café-bound, said 你好世界 😀🎉!",
    "长城很长。🚀🚀 Zürich Ångström 👨‍👩‍👧",
    "日本語 Привет 👍🏽 ελληνικά مرحبا",
]
EOS_TEXT = "<|endoftext|>"


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    """A byte-level BPE small enough that emoji and most CJK characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS_TEXT, "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


@pytest.fixture(scope="module", params=["tokenizers", "transformers"])
def tokenizer(request, raw_tokenizer):
    if request.param == "tokenizers":
        return raw_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, eos_token=EOS_TEXT)


def _ids(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _eos(tokenizer) -> int:
    return tokenizer.token_to_id(EOS_TEXT) if isinstance(tokenizer, Tokenizer) else tokenizer.eos_token_id


@pytest.mark.parametrize("text", SAMPLES)
def test_deltas_never_split_a_character_and_add_up_to_the_full_decode(tokenizer, text):
    ids = _ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, _ids(tokenizer, "Prompt: 你好 "))
    deltas = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == decode(tokenizer, ids) == text
    assert detok.output_text == text and detok.output_token_ids == ids
    # The text really has characters spread over several byte tokens, so something was held.
    assert deltas.count("") >= 1


def test_several_tokens_at_once_give_the_same_text(tokenizer):
    ids = _ids(tokenizer, SAMPLES[0] + SAMPLES[1])
    detok = IncrementalDetokenizer(tokenizer, [])
    rng = random.Random(0)
    out, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4)
        out.append(detok.add_tokens(ids[i : i + step]))
        i += step
    assert all("\ufffd" not in d for d in out)
    assert "".join(out) == SAMPLES[0] + SAMPLES[1]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_ids_including_broken_bytes_and_specials_match_the_full_decode(
    tokenizer, raw_tokenizer, skip_special_tokens, seed
):
    rng = random.Random(seed)
    vocab = raw_tokenizer.get_vocab_size()
    ids = [rng.randrange(vocab) for _ in range(60)]
    detok = IncrementalDetokenizer(tokenizer, [rng.randrange(vocab) for _ in range(8)], skip_special_tokens)
    text = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
    assert text == decode(tokenizer, ids, skip_special_tokens)
    assert detok.flush() == ""


def test_special_tokens_are_rendered_only_when_not_skipped(tokenizer):
    ids = _ids(tokenizer, "fox") + [_eos(tokenizer)] + _ids(tokenizer, " dog")
    for skip, expected in ((True, "fox dog"), (False, f"fox{EOS_TEXT} dog")):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        assert "".join(detok.add_tokens([t]) for t in ids) == expected


class _CountingTokenizer:
    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_short_window_not_the_whole_output(raw_tokenizer):
    counting = _CountingTokenizer(raw_tokenizer)
    ids = raw_tokenizer.encode(" ".join(SAMPLES * 10)).ids
    detok = IncrementalDetokenizer(counting, list(range(100, 120)))
    text = "".join(detok.add_tokens([t]) for t in ids)
    assert text == raw_tokenizer.decode(ids)
    assert len(ids) > 300 and counting.longest <= 10


# --- stop strings ---------------------------------------------------------------------------


def test_a_stop_string_split_across_deltas_is_cut_and_never_streamed():
    checker = StopChecker(["###"])
    streamed = [checker.add_text(d) for d in ["Hel", "lo #", "#", "# bye"]]
    assert streamed == ["Hel", "lo ", "", ""]
    assert checker.stop_str == "###" and checker.text == "Hello "
    assert checker.flush() == ""


def test_include_stop_str_in_output_keeps_the_stop_string():
    checker = StopChecker(["###"], include_stop_str_in_output=True)
    streamed = [checker.add_text(d) for d in ["a#", "#", "#b"]]
    assert "".join(streamed) + checker.flush() == "a###" == checker.text


def test_a_partial_match_is_released_once_it_cannot_be_a_stop_string():
    checker = StopChecker(["##", "xyz"])
    assert checker.add_text("a#") == "a"
    assert checker.add_text("b") == "#b"
    assert checker.add_text("xy") == ""
    assert checker.add_text("w") == "xyw"
    assert checker.stop_str is None and checker.flush() == ""


def test_the_stop_string_completed_first_wins_whatever_the_chunking():
    for deltas in (["hello world"], ["hel", "lo wor", "ld"], list("hello world")):
        checker = StopChecker(["world", "o w", "lo w"])
        for d in deltas:
            checker.add_text(d)
        assert checker.stop_str == "lo w" and checker.text == "hel"


def test_held_text_is_flushed_when_the_sequence_ends_for_another_reason():
    checker = StopChecker(["STOP"])
    assert checker.add_text("go ST") == "go "
    assert checker.flush() == "ST"


def test_unchecked_text_is_not_searched_but_a_later_straddling_match_is():
    checker = StopChecker(["ab"])
    assert checker.add_text("ab xa", check=False) == "ab x"  # before min_tokens: no stop yet
    assert checker.stop_str is None
    assert checker.add_text("b") == ""  # the match straddles the unchecked text
    assert checker.stop_str == "ab" and checker.text == "ab x"


def test_check_stop_covers_eos_stop_ids_strings_and_length():
    p = SamplingParams(max_tokens=5, stop_token_ids=[7])
    eos = [2]
    assert check_stop([1, 2], 2, p, eos, 2, False) == ("stop", None)
    assert check_stop([1, 7], 7, p, eos, 2, False) == ("stop", 7)
    assert check_stop([1, 4], 4, p, eos, 2, False, stop_str="##") == ("stop", "##")
    assert check_stop([1, 4], 4, p, eos, 2, False) == (None, None)
    assert check_stop([1] * 5, 1, p, eos, 5, False) == ("length", None)
    assert check_stop([1, 4], 4, p, eos, 2, True) == ("length", None)
    assert check_stop([1] * 4 + [2], 2, p, eos, 5, False) == ("stop", None)


def test_check_stop_ignores_eos_when_asked_and_waits_for_min_tokens():
    eos = [2]
    assert check_stop([2], 2, SamplingParams(ignore_eos=True), eos, 1, False) == (None, None)
    p = SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=4)
    assert check_stop([2, 7], 7, p, eos, 2, False, stop_str="x") == (None, None)
    assert check_stop([2, 7, 7], 7, p, eos, 3, False) == ("stop", 7)
    assert check_stop([2, 2], 2, p, eos, 2, True) == ("length", None)


def _stream(tokenizer, params, ids, prompt=""):
    stream = OutputStream(tokenizer, _ids(tokenizer, prompt), params, [_eos(tokenizer)])
    pieces: list[str] = []
    prefixes: list[str] = []
    for t in ids:
        step = stream.append_token(t)
        pieces.append(step.text)
        prefixes.append("".join(pieces))
        if step.finish_reason is not None:
            break
    return stream, pieces, prefixes


def test_a_stop_string_spanning_tokens_is_excluded_and_never_partly_streamed(tokenizer):
    stop = "lazy dog"
    text = "The quick brown fox jumps over the lazy dog and keeps running 😀"
    ids = _ids(tokenizer, text)
    assert not any(stop in decode(tokenizer, [t]) for t in ids)  # it really spans tokens
    stream, pieces, prefixes = _stream(tokenizer, SamplingParams(stop=[stop], max_tokens=100), ids)
    expected = "The quick brown fox jumps over the "
    assert stream.finish_reason == "stop" and stream.stop_reason == stop
    assert "".join(pieces) == expected == stream.output_text
    assert all(expected.startswith(p) for p in prefixes)
    # Stopped at the token that completed the stop string, not later.
    assert decode(tokenizer, stream.output_token_ids).endswith("dog")


def test_eos_ends_the_stream_and_is_not_rendered_even_unskipped(tokenizer):
    ids = _ids(tokenizer, "fox 😀") + [_eos(tokenizer)] + _ids(tokenizer, "more")
    params = SamplingParams(skip_special_tokens=False, max_tokens=50)
    stream, pieces, _ = _stream(tokenizer, params, ids)
    assert (stream.finish_reason, stream.stop_reason) == ("stop", None)
    assert "".join(pieces) == "fox 😀" and stream.output_token_ids[-1] == _eos(tokenizer)


def test_ignore_eos_keeps_generating_through_eos_until_max_tokens(tokenizer):
    ids = _ids(tokenizer, "fox") + [_eos(tokenizer)] + _ids(tokenizer, " dog")
    params = SamplingParams(ignore_eos=True, max_tokens=len(ids))
    stream, pieces, _ = _stream(tokenizer, params, ids)
    assert stream.finish_reason == "length" and stream.output_token_ids == ids
    assert "".join(pieces) == "fox dog"


def test_min_tokens_lets_an_early_stop_string_through(tokenizer):
    ids = _ids(tokenizer, "fox. fox. fox.")
    params = SamplingParams(stop=["."], min_tokens=len(_ids(tokenizer, "fox. fox")), max_tokens=50)
    stream, pieces, _ = _stream(tokenizer, params, ids)
    assert stream.finish_reason == "stop" and stream.output_text == "fox. fox"
    assert "".join(pieces) == "fox. fox"


def test_a_stop_token_id_is_reported_and_excluded(tokenizer):
    ids = _ids(tokenizer, "brown fox jumps")
    stop_id = ids[3]
    stream, pieces, _ = _stream(tokenizer, SamplingParams(stop_token_ids=[stop_id], max_tokens=50), ids)
    assert (stream.finish_reason, stream.stop_reason) == ("stop", stop_id)
    assert "".join(pieces) == decode(tokenizer, ids[:3])


def test_max_tokens_flushes_a_held_partial_character(tokenizer):
    ids = _ids(tokenizer, "ok 😀")
    stream, pieces, _ = _stream(tokenizer, SamplingParams(max_tokens=len(ids) - 1), ids)
    assert stream.finish_reason == "length"
    assert "".join(pieces) == decode(tokenizer, ids[:-1])
    assert pieces[-1].endswith("\ufffd")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab#c", max_size=30),
    stops=st.lists(st.text(alphabet="ab#c", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
    include=st.booleans(),
)
def test_stop_checking_is_the_same_however_the_text_is_chunked(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    checker = StopChecker(stops, include_stop_str_in_output=include)
    streamed = ""
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        streamed += checker.add_text(text[lo:hi])
        # What was streamed is never taken back: it is a prefix of the final text.
        assert _final(text, stops, include).startswith(streamed)
    streamed += checker.flush()
    assert streamed == checker.text == _final(text, stops, include)


def _final(text: str, stops: list[str], include: bool) -> str:
    """Reference: cut at the match that ends first (the longest one on a tie)."""
    matches = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if not matches:
        return text
    end, start = min(matches)
    return text[:end] if include else text[:start]


def _held_back(text: str, stops: list[str]) -> int:
    """Reference: the longest tail of the text that is a proper prefix of a stop string."""
    return max(
        (k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(
    deltas=st.lists(st.text(alphabet="aab#", min_size=1, max_size=6), max_size=8),
    stops=st.lists(st.text(alphabet="ab#", min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_only_a_tail_that_may_still_become_a_stop_string_is_held_back(deltas, stops):
    checker = StopChecker(stops)
    streamed = ""
    for delta in deltas:
        streamed += checker.add_text(delta)
        if checker.stop_str is not None:
            break
        assert len(checker.text) - len(streamed) == _held_back(checker.text, stops)


def test_stop_strings_longer_than_the_limit_are_refused_by_the_engine():
    from engine.rules import MAX_STOP_STRING_CHARS
    from engine.sampling_params import SamplingParamsError

    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    with pytest.raises(SamplingParamsError, match="at most 256 characters"):
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])
