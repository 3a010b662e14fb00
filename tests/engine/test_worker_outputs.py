"""A quiet request's deltas held back and merged by the replica (engine.worker.outputs)."""

from __future__ import annotations

from engine.protocol import DeltaOutput, Event, FinishedOutput, Usage
from engine.worker.outputs import QUIET_PUBLISH_S, HeldRequest
from engine.worker.queue import EntryRef


def held() -> HeldRequest:
    return HeldRequest(
        request_id="q", message_id=EntryRef("requests", b"1-0"), n=2, num_prompt_tokens=3, quiet=True
    )


def delta(*outputs: tuple[int, str, list[int]], prompt_logprobs=None) -> Event:
    event = Event.delta(
        [
            DeltaOutput(
                index=i,
                text=text,
                token_ids=ids,
                logprobs=[{"token_id": t, "logprob": -0.5, "top": []} for t in ids],
            )
            for i, text, ids in outputs
        ]
    )
    event.prompt_logprobs = prompt_logprobs
    return event


def test_deltas_are_held_until_the_oldest_has_waited_the_publish_period_then_go_as_one():
    request = held()
    first = delta((0, "a", [1]), (1, "b", [2]))

    assert request.to_publish([first], now=100.0) == []
    assert request.to_publish([delta((1, "c", [3]))], now=100.0 + QUIET_PUBLISH_S / 2) == []
    [merged] = request.to_publish([delta((0, "d", [4]), (1, "e", [5]))], now=100.0 + QUIET_PUBLISH_S)

    assert merged.type == "delta"
    assert merged.outputs == [
        {"index": 0, "text": "ad", "token_ids": [1, 4], "logprobs": [
            {"token_id": 1, "logprob": -0.5, "top": []}, {"token_id": 4, "logprob": -0.5, "top": []}]},
        {"index": 1, "text": "bce", "token_ids": [2, 3, 5], "logprobs": [
            {"token_id": t, "logprob": -0.5, "top": []} for t in (2, 3, 5)]},
    ]  # fmt: skip
    # What was passed in is not changed by the merge.
    assert first.outputs[0]["token_ids"] == [1] and first.outputs[0]["text"] == "a"
    assert request.held_back is None
    # The period starts again with the next delta held.
    assert request.to_publish([delta((0, "f", [6]))], now=200.0) == []
    assert request.to_publish([], now=200.0 + QUIET_PUBLISH_S * 0.9) == []


def test_an_end_publishes_what_was_held_before_it_and_the_prompt_logprobs_are_kept():
    request = held()
    request.to_publish([delta((0, "a", [1]), prompt_logprobs=[None, {"token_id": 9}])], now=1.0)
    finished = Event.finished([FinishedOutput(index=0, finish_reason="length")], Usage(3, 2))

    out = request.to_publish([delta((0, "b", [2])), finished], now=1.1)

    assert [e.type for e in out] == ["delta", "finished"]
    assert out[0].outputs[0]["token_ids"] == [1, 2] and out[0].outputs[0]["text"] == "ab"
    assert out[0].prompt_logprobs == [None, {"token_id": 9}]
    assert out[1] is finished
    assert request.release() == []
