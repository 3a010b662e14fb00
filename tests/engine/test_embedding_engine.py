"""The embedding engine (engine.embedding_engine) on all-MiniLM-L6-v2: requests of many inputs
packed into steps within the token budget, each vector what the encoder gives that input alone;
fair share across tenants (a query is not held behind another tenant's corpus); deadlines, aborts
and refusals; and a replica process (`engine.serve` on the encoder directory) answering embed
requests from its Redis stream, and refusing generation."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from engine.config import EngineConfig, SchedulerConfig
from engine.embedding_engine import MAX_INPUTS, EmbeddingEngine
from engine.errors import InvalidRequestError, RequestTooLargeError
from engine.models.bert import load_encoder, load_pooling, pool
from engine.protocol import ErrorCode, FinishReason, GenerateRequest, requests_stream
from tests.engine.test_worker import REDIS_URL, Workers, events_of, new_prefix, stats_of, wait_events

pytestmark = [pytest.mark.real_model]

MODEL = "tiny-chat"  # the name tests.engine.test_worker's Workers serve under


def _vector(wire: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(wire), dtype="<f4").copy())


@pytest.fixture(scope="module")
def tokenizer(minilm_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path):
    model = load_encoder(minilm_dir, dtype=torch.float32, device=torch.device("cpu"))
    pooling = load_pooling(minilm_dir)

    def embed_alone(ids: list[int]) -> torch.Tensor:
        return pool(model(torch.tensor(ids), [len(ids)]), [len(ids)], pooling)[0]

    return embed_alone


def _engine(minilm_dir: Path, **scheduler) -> EmbeddingEngine:
    return EmbeddingEngine.from_config(
        EngineConfig(model=str(minilm_dir), device="cpu", scheduler=SchedulerConfig(**scheduler))
    )


def _run(engine: EmbeddingEngine, max_steps: int = 200) -> dict[str, object]:
    done: dict[str, object] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for output in engine.step():
            done[output.request_id] = output
    raise AssertionError("the engine did not finish its requests")


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in texts]


def test_requests_of_many_inputs_are_packed_and_each_vector_is_its_inputs(
    minilm_dir, tokenizer, reference
) -> None:
    engine = _engine(minilm_dir, max_num_batched_tokens=32, max_num_seqs=8)
    first = _ids(tokenizer, ["a cat sat on the mat", "rivers run to the sea " * 6, "hello"])
    second = _ids(tokenizer, ["the stock market fell today", "x"])
    engine.add_embedding_request("one", first, tenant="a")
    engine.add_embedding_request("two", second, tenant="a")
    steps = 0
    done: dict[str, object] = {}
    while engine.has_unfinished_requests():
        steps += 1
        for output in engine.step():
            done[output.request_id] = output
        assert engine.num_running <= 8
    assert steps >= 2  # 32 tokens a step cannot hold all five inputs
    for request_id, inputs in (("one", first), ("two", second)):
        output = done[request_id]
        assert output.finished and output.num_prompt_tokens == sum(len(i) for i in inputs)
        assert [o.finish_reason for o in output.outputs] == [FinishReason.STOP] * len(inputs)
        for wire, ids in zip(output.embeddings, inputs, strict=True):
            assert torch.allclose(_vector(wire), reference(ids), atol=1e-5)


def test_an_input_longer_than_the_step_budget_runs_alone(minilm_dir, tokenizer, reference) -> None:
    engine = _engine(minilm_dir, max_num_batched_tokens=16, max_num_seqs=8)
    long = tokenizer("word " * 200)["input_ids"]
    engine.add_embedding_request("long", [long, [101, 102]], tenant="a")
    output = _run(engine)["long"]
    assert torch.allclose(_vector(output.embeddings[0]), reference(long), atol=1e-5)


def test_another_tenants_query_is_not_held_behind_a_corpus(minilm_dir, tokenizer) -> None:
    engine = _engine(minilm_dir, max_num_batched_tokens=256, max_num_seqs=4)
    corpus = _ids(tokenizer, [f"passage number {i} about gardening and soil" for i in range(64)])
    engine.add_embedding_request("corpus", corpus, tenant="big")
    engine.step()  # the corpus is under way
    engine.add_embedding_request(
        "query", _ids(tokenizer, ["how deep should I plant tulips?"]), tenant="small"
    )
    finished_at: dict[str, int] = {}
    for step in range(1, 100):
        for output in engine.step():
            finished_at[output.request_id] = step
        if not engine.has_unfinished_requests():
            break
    assert finished_at["query"] <= 2 < finished_at["corpus"]


def test_a_request_past_its_deadline_before_it_starts_times_out(minilm_dir) -> None:
    engine = _engine(minilm_dir)
    engine.add_embedding_request("late", [[101, 2000, 102]], tenant="a", deadline=time.time() - 1)
    engine.add_embedding_request("fine", [[101, 2001, 102]], tenant="a", deadline=time.time() + 60)
    done = _run(engine)
    assert done["late"].error_code == ErrorCode.QUEUE_TIMEOUT and done["late"].num_prompt_tokens == 0
    assert done["fine"].embeddings and done["fine"].error is None


def test_an_aborted_request_ends_with_abort_and_frees_its_tenant(minilm_dir) -> None:
    engine = _engine(minilm_dir, max_num_batched_tokens=16, max_num_seqs=1)
    engine.add_embedding_request("gone", [[101, 2000 + i, 102] for i in range(10)], tenant="a")
    engine.step()
    engine.abort_request("gone")
    [output] = engine.step()
    assert output.request_id == "gone" and output.finished and output.embeddings is None
    assert {o.finish_reason for o in output.outputs} == {FinishReason.ABORT}
    assert not engine.has_unfinished_requests() and not engine.service.is_active("a")


def test_what_an_embedding_engine_refuses(minilm_dir) -> None:
    engine = _engine(minilm_dir)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        engine.add_request("gen", [101, 102], None)
    with pytest.raises(InvalidRequestError, match="at least one input"):
        engine.add_embedding_request("none", [])
    with pytest.raises(InvalidRequestError, match="input 1 is empty"):
        engine.add_embedding_request("empty", [[101], []])
    with pytest.raises(RequestTooLargeError, match="at most 512"):
        engine.add_embedding_request("long", [[101] * 513])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_embedding_request("vocab", [[101, 30522]])
    with pytest.raises(RequestTooLargeError, match=f"at most {MAX_INPUTS} inputs"):
        engine.add_embedding_request("many", [[101]] * (MAX_INPUTS + 1))
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_replica_of_an_encoder_answers_embed_requests_and_refuses_generation(
    minilm_dir, tokenizer, reference, tmp_path
) -> None:
    prefix = new_prefix()
    workers = Workers(minilm_dir, prefix, tmp_path)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        workers.start("embed-1")
        workers.wait_ready("embed-1")
        inputs = _ids(tokenizer, ["The capital of France is Paris.", "Tulips are planted in autumn."])
        request = GenerateRequest(
            request_id="emb-1",
            model=MODEL,
            prompt_token_ids=[],
            sampling_params={},
            tenant="t",
            task="embed",
            inputs=inputs,
        )
        client.xadd(requests_stream(prefix, MODEL), request.encode())
        events = wait_events(client, prefix, "emb-1")
        assert [e.type for e in events] == ["finished"]
        [finished] = events
        assert finished.usage == {
            "prompt_tokens": sum(map(len, inputs)),
            "completion_tokens": 0,
            "cached_tokens": 0,
        }
        for out, ids in zip(finished.outputs, inputs, strict=True):
            assert out["finish_reason"] == "stop"
            assert torch.allclose(_vector(out["embedding"]), reference(ids), atol=1e-5)
        generate = GenerateRequest(
            request_id="gen-1",
            model=MODEL,
            prompt_token_ids=[101, 102],
            sampling_params={"max_tokens": 4},
            tenant="t",
        )
        client.xadd(requests_stream(prefix, MODEL), generate.encode())
        [refused] = wait_events(client, prefix, "gen-1")
        assert refused.type == "error" and refused.code == ErrorCode.INVALID_REQUEST
        assert "does not generate" in refused.message
        stats = stats_of(client, prefix, "embed-1")
        assert stats is not None and stats.num_total_blocks == 0
        assert events_of(client, prefix, "emb-1") == events
    finally:
        workers.close()
        client.close()
