"""/v1/embeddings through the whole stack from a decoder deployed with task embed (SmolLM2-135M, as an
embedding model built on a Llama-family decoder would be): the openai SDK gets transformers' last
token states, normalized, batched or alone; the model is listed; chat with it is refused; and the
ledger bills the input tokens."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from tenants.models import UsageRecord
from tests.e2e.processes import spawn
from tests.e2e.stack import ServingStack, served_world
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.real_model, pytest.mark.django_db]

MODEL = "smollm2-embed"
TEXTS = [
    "The capital of France is Paris.",
    "Tulips are planted in autumn, before the first frost.",
    "x",
    "A long text about rivers. " * 30,
]


@dataclass
class Embeddings:
    stack: ServingStack
    client: openai.OpenAI


@pytest.fixture(scope="module")
def api(committed_db, smollm2_dir: Path, tmp_path_factory) -> Iterator[Embeddings]:
    env = {"PAGODA_MEDIA_DIR": str(tmp_path_factory.mktemp("embed-media")), "OMP_NUM_THREADS": "1"}
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["solo"],
        max_model_len=512,
        model=MODEL,
        model_dir=smollm2_dir,
        engine_settings={"max_num_seqs": 16},
        task="embed",
        env=env,
        tenant_a={"name": "Decoder embeddings", "slug": "e2e-decoder-embeddings"},
    ) as (base, stack):
        # A Batch API runner, for the embedding batch below.
        log = tmp_path_factory.mktemp("embed-batches") / "worker.log"
        worker = spawn(
            "celery-batches",
            [sys.executable, "-m", "celery", "-A", "config", "worker", "-Q", "batches,celery", "--pool=solo"],
            log,
            **env,
        )
        try:
            yield Embeddings(stack, stack.client(base.raw_key_a, timeout=180.0))
        finally:
            worker.stop(grace_s=5)


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path):
    """transformers' SmolLM2 base model: each text alone, its last token's final state, normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModel.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()

    def embed(text: str) -> tuple[np.ndarray, int]:
        ids = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=0).numpy(), len(ids)

    return embed


def test_the_vectors_are_the_decoders_last_token_states(api: Embeddings, reference) -> None:
    reply = api.client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert reply.model == MODEL and [d.index for d in reply.data] == list(range(len(TEXTS)))
    tokens = 0
    for datum, text in zip(reply.data, TEXTS, strict=True):
        expected, count = reference(text)
        ours = np.array(datum.embedding, dtype=np.float32)
        assert ours.shape == (576,)
        assert float(ours @ expected / np.linalg.norm(ours)) >= 0.99999
        tokens += count
    assert reply.usage.prompt_tokens == tokens
    # Alone (and through the SDK's base64 default), each text gets the vector it got in the batch.
    alone = api.client.embeddings.create(model=MODEL, input=TEXTS[1])
    assert np.allclose(alone.data[0].embedding, reply.data[1].embedding, atol=1e-5)


def test_the_model_is_listed_billed_and_refuses_chat(api: Embeddings) -> None:
    assert MODEL in [m.id for m in api.client.models.list().data]
    raw = api.client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS[:2])
    reply = raw.parse()
    row = wait_until(
        lambda: UsageRecord.objects.filter(request_id=raw.headers["x-request-id"]).first(), timeout=60
    )
    assert (row.prompt_tokens, row.completion_tokens) == (reply.usage.prompt_tokens, 0)
    with pytest.raises(openai.BadRequestError, match="computes embeddings") as refused:
        api.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "model_task_mismatch"


def test_a_batch_of_embedding_lines_answers_as_the_endpoint_does(api: Embeddings) -> None:
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": text},
        }
        for i, text in enumerate(TEXTS)
    ]
    lines.append(
        {
            "custom_id": "empty",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": []},
        }
    )
    data = "\n".join(json.dumps(line) for line in lines).encode()
    file_id = api.client.files.create(file=("embed.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = api.client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = wait_until(
        lambda: (b := api.client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
        timeout=300,
        interval=0.5,
        what="the embedding batch to end",
    )
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 4, 1)
    text = api.client.files.content(done.output_file_id).text
    outputs = {row["custom_id"]: row for row in map(json.loads, text.splitlines())}
    for i, text in enumerate(TEXTS):
        body = outputs[f"e{i}"]["response"]["body"]
        interactive = api.client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] == interactive.usage.prompt_tokens
        assert np.allclose(body["data"][0]["embedding"], interactive.data[0].embedding, atol=1e-5)
    [error] = map(json.loads, api.client.files.content(done.error_file_id).text.splitlines())
    assert error["custom_id"] == "empty" and error["response"]["body"]["error"]["param"] == "input"
