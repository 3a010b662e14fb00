from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.errors import EngineError
from engine.sequence import InvalidRequestError, RequestTooLargeError, Sequence, SequenceStatus


@dataclass
class Params:
    max_tokens: int = 8
    n: int = 1
    prompt_logprobs: int | None = None  # as SamplingParams: none asked for


def test_new_sequence_is_waiting_with_nothing_computed():
    seq = Sequence(
        "r1", [5, 6, 7], Params(), tenant="a", priority=2, cache_salt="s", lora_id=3, arrival_time=1.5
    )

    assert seq.status is SequenceStatus.WAITING
    assert (seq.request_id, seq.index, seq.tenant, seq.priority) == ("r1", 0, "a", 2)
    assert (seq.cache_salt, seq.lora_id, seq.arrival_time) == ("s", 3, 1.5)
    assert seq.token_ids == [5, 6, 7]
    assert (seq.num_prompt_tokens, seq.num_output_tokens, seq.num_tokens) == (3, 0, 3)
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.block_table) == (0, 0, [])
    assert seq.finish_reason is None and not seq.is_finished
    assert seq.max_tokens == 8


def test_seq_ids_are_unique():
    seqs = [Sequence("r", [1], Params(), index=i) for i in range(3)]

    assert len({s.seq_id for s in seqs}) == 3


def test_append_token_grows_outputs_and_token_ids():
    seq = Sequence("r", [1, 2], Params())

    seq.append_token(9)
    seq.append_token(4)

    assert seq.output_token_ids == [9, 4]
    assert seq.token_ids == [1, 2, 9, 4]
    assert seq.prompt_token_ids == [1, 2]
    assert seq.last_token_id == 4
    assert (seq.num_tokens, seq.num_output_tokens) == (4, 2)


def test_is_prefill_until_only_the_last_token_is_uncomputed():
    seq = Sequence("r", [1, 2, 3, 4], Params())
    assert seq.is_prefill

    seq.num_computed_tokens = 2
    assert seq.is_prefill

    seq.num_computed_tokens = 4
    seq.append_token(5)  # a decode now feeds exactly the sampled token
    assert not seq.is_prefill
    assert seq.num_uncomputed_tokens == 1


def test_finished_statuses():
    finished = {s for s in SequenceStatus if s.is_finished}

    assert finished == {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    }


def test_empty_prompt_is_refused():
    with pytest.raises(InvalidRequestError):
        Sequence("r", [], Params())


def test_errors_share_one_base():
    assert issubclass(RequestTooLargeError, EngineError)
    assert issubclass(InvalidRequestError, EngineError)
