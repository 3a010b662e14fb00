"""Embedding models built on decoders (the Llama family: Llama, Mistral, Qwen2, Qwen3): the embedding
engine runs the decoder causally over each packed input with no KV cache and pools its last token
(or what the directory's sentence-transformers files say). Parity with transformers' own model and
with sentence-transformers, batched equal to alone, the sliding window, and a replica started with
`--task embed` answering embed requests and refusing generation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis
import torch
import torch.nn.functional as F

from engine.config import ConfigError, EngineConfig, SchedulerConfig
from engine.embedding_engine import EmbeddingEngine
from engine.models.bert import Pooling
from engine.protocol import ErrorCode, GenerateRequest, requests_stream
from engine.rules import model_task, model_tasks
from engine.serve import build_parser, engine_config_from_args
from tests.engine.test_embedding_engine import _run, _vector
from tests.engine.test_worker import REDIS_URL, Workers, new_prefix, wait_events

MODEL = "tiny-chat"  # the name tests.engine.test_worker's Workers serve under

TEXTS = [
    "def main():",
    "import os\nimport sys\n\nprint(sys.argv)",
    "x",
    "class Foo(Bar):\n    '''A docstring that runs on for a while.'''\n    pass\n" * 3,
    "return None",
]


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' base model on the input alone: the last token's final state, normalized."""
    from transformers import AutoModel

    model = _reference.cache.get(model_dir)  # type: ignore[attr-defined]
    if model is None:
        model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
        _reference.cache[model_dir] = model.eval()  # type: ignore[attr-defined]
    with torch.inference_mode():
        states = model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(states[-1].float(), dim=0)


_reference.cache = {}  # type: ignore[attr-defined]


def _engine(model_dir: Path, **scheduler) -> EmbeddingEngine:
    return EmbeddingEngine.from_config(
        EngineConfig(model=str(model_dir), task="embed", device="cpu", scheduler=SchedulerConfig(**scheduler))
    )


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_decoder_embeds_each_input_as_transformers_last_token_state(arch, request) -> None:
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    tokenizer = _tokenizer(model_dir)
    inputs = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine = _engine(model_dir, max_num_batched_tokens=64, max_num_seqs=8)
    assert engine.pooling == Pooling(mode="last", normalize=True)
    engine.add_embedding_request("all", inputs, tenant="t")
    [output] = _run(engine).values()
    assert output.num_prompt_tokens == sum(map(len, inputs))
    vectors = [_vector(wire) for wire in output.embeddings]
    for ids, vector in zip(inputs, vectors, strict=True):
        expected = _reference(model_dir, ids)
        assert F.cosine_similarity(vector, expected, dim=0) >= 0.99999
        assert torch.allclose(vector, expected, atol=2e-5)
    # Each input alone gives the vector it got packed with the others.
    alone = _engine(model_dir, max_num_batched_tokens=2048, max_num_seqs=1)
    for i, ids in enumerate(inputs):
        alone.add_embedding_request(f"one-{i}", [ids], tenant="t")
    for i, out in sorted(_run(alone).items()):
        index = int(i.removeprefix("one-"))
        assert torch.allclose(_vector(out.embeddings[0]), vectors[index], atol=1e-6)


def test_an_input_longer_than_the_sliding_window_attends_within_it(tiny_mistral_dir, tmp_path) -> None:
    model_dir = tmp_path / "windowed"
    shutil.copytree(tiny_mistral_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 8
    (model_dir / "config.json").write_text(json.dumps(config))
    tokenizer = _tokenizer(model_dir)
    ids = tokenizer(TEXTS[3])["input_ids"]
    assert len(ids) > 3 * 8
    engine = _engine(model_dir)
    engine.add_embedding_request("long", [ids, ids[:6]], tenant="t")
    [output] = _run(engine).values()
    windowed = _vector(output.embeddings[0])
    assert torch.allclose(windowed, _reference(model_dir, ids), atol=2e-5)
    assert torch.allclose(_vector(output.embeddings[1]), _reference(model_dir, ids[:6]), atol=2e-5)
    # The window changes the answer: without it the same input embeds differently.
    assert not torch.allclose(windowed, _reference(tiny_mistral_dir, ids), atol=1e-3)


def test_the_directorys_sentence_transformers_pooling_is_used_and_matches_it(
    tiny_qwen2_dir, tmp_path
) -> None:
    """A sentence-transformers directory on a decoder (as gte-Qwen2 ships): its Pooling module's mode
    and Normalize decide, and the vectors equal SentenceTransformer.encode's."""
    from sentence_transformers import SentenceTransformer

    model_dir = tmp_path / "st-qwen2"
    shutil.copytree(tiny_qwen2_dir, model_dir)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    engine = _engine(model_dir)
    assert engine.pooling == Pooling(mode="mean", normalize=False)
    tokenizer = _tokenizer(model_dir)
    inputs = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine.add_embedding_request("st", inputs, tenant="t")
    [output] = _run(engine).values()
    st = SentenceTransformer(str(model_dir), device="cpu")
    expected = st.encode(TEXTS, batch_size=1, convert_to_tensor=True)  # one by one: no padding
    for wire, reference in zip(output.embeddings, expected, strict=True):
        assert F.cosine_similarity(_vector(wire), reference.float(), dim=0) >= 0.99999


def test_which_models_may_embed_and_which_may_generate(tiny_llama_dir, minilm_dir) -> None:
    llama = json.loads((tiny_llama_dir / "config.json").read_text())
    bert = json.loads((minilm_dir / "config.json").read_text())
    assert model_tasks(llama) == ("generate", "embed") and model_task(llama) == "generate"
    assert model_task(llama, "embed") == "embed"
    assert model_tasks(bert) == ("embed",) and model_task(bert, "embed") == "embed"
    with pytest.raises(ValueError, match="encoder .* cannot generate"):
        model_task(bert, "generate")
    with pytest.raises(ValueError, match="task must be one of"):
        model_task(llama, "rerank")
    with pytest.raises(ConfigError, match="task must be"):
        EngineConfig(model=str(tiny_llama_dir), task="classify")
    args = build_parser().parse_args(
        [
            "--model-dir",
            str(tiny_llama_dir),
            "--served-name",
            "m",
            "--redis-url",
            REDIS_URL,
            "--task",
            "embed",
        ]
    )
    assert engine_config_from_args(args).task == "embed"


def test_a_replica_told_to_embed_answers_embed_requests_and_refuses_generation(
    tiny_qwen2_dir, minilm_dir, tmp_path
) -> None:
    tokenizer = _tokenizer(tiny_qwen2_dir)
    prefix = new_prefix()
    workers = Workers(tiny_qwen2_dir, prefix, tmp_path)
    encoders = Workers(minilm_dir, new_prefix(), tmp_path)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        workers.start("dec-embed", "--task", "embed")
        # An encoder cannot be told to generate: the replica says so and exits with status 2.
        refused = encoders.start("bert-generate", "--task", "generate")
        assert refused.wait(timeout=120) == 2
        assert "is an encoder (BERT family): it embeds, it cannot generate" in encoders.log("bert-generate")
        workers.wait_ready("dec-embed")
        inputs = [tokenizer(t)["input_ids"] for t in TEXTS[:3]]
        request = GenerateRequest(
            request_id="emb-dec",
            model=MODEL,
            prompt_token_ids=[],
            sampling_params={},
            tenant="t",
            task="embed",
            inputs=inputs,
        )
        client.xadd(requests_stream(prefix, MODEL), request.encode())
        [finished] = wait_events(client, prefix, "emb-dec")
        assert finished.type == "finished"
        assert finished.usage is not None and finished.usage["prompt_tokens"] == sum(map(len, inputs))
        for out, ids in zip(finished.outputs, inputs, strict=True):
            assert torch.allclose(_vector(out["embedding"]), _reference(tiny_qwen2_dir, ids), atol=2e-5)
        generate = GenerateRequest(
            request_id="gen-dec",
            model=MODEL,
            prompt_token_ids=inputs[0],
            sampling_params={"max_tokens": 4},
            tenant="t",
        )
        client.xadd(requests_stream(prefix, MODEL), generate.encode())
        [error] = wait_events(client, prefix, "gen-dec")
        assert error.type == "error" and error.code == ErrorCode.INVALID_REQUEST
        assert "does not generate" in error.message
    finally:
        workers.close()
        encoders.close()
        client.close()
