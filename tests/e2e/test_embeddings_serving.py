"""/v1/embeddings through the whole stack (daphne, Redis, an embedding replica of all-MiniLM-L6-v2)
with the official openai SDK and LangChain's OpenAIEmbeddings: the vectors sentence-transformers
computes, floats and base64, `dimensions`, token-id inputs, the context bound and vLLM's
truncate_prompt_tokens, the ledger, a chat request to the embedding model refused, and a retrieval
sanity check."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tenants.models import UsageRecord
from tests.e2e.stack import ServingStack, served_world
from tests.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.real_model, pytest.mark.django_db]

MODEL = "minilm-embed"
TEXTS = [
    "The capital of France is Paris.",
    "Tulips are planted in autumn, before the first frost.",
    "x",
    "A long text about rivers. " * 40,
]


@dataclass
class Embeddings:
    stack: ServingStack
    raw_key: str
    client: openai.OpenAI


@pytest.fixture(scope="module")
def api(committed_db, minilm_dir: Path, tmp_path_factory) -> Iterator[Embeddings]:
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["solo"],
        max_model_len=512,
        model=MODEL,
        model_dir=minilm_dir,
        engine_settings={"max_num_seqs": 64},
        tenant_a={"name": "Embeddings", "slug": "e2e-embeddings"},
    ) as (base, stack):
        yield Embeddings(stack, base.raw_key_a, stack.client(base.raw_key_a, timeout=180.0))


@pytest.fixture(scope="module")
def reference(minilm_dir: Path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    model.max_seq_length = 512
    return model


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_vectors_are_sentence_transformers_vectors(api: Embeddings, reference) -> None:
    reply = api.client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert reply.object == "list" and reply.model == MODEL
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    ours = np.array([d.embedding for d in reply.data], dtype=np.float32)
    theirs = reference.encode(TEXTS, convert_to_numpy=True)
    assert ours.shape == (len(TEXTS), 384)
    assert _cosines(ours, theirs).min() >= 0.99999
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens


def test_base64_is_little_endian_float32_as_the_sdk_decodes_it(api: Embeddings) -> None:
    floats = api.client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    # The SDK asks for base64 when no format is given, and decodes it into floats.
    default = api.client.embeddings.create(model=MODEL, input="hello world")
    assert np.allclose(default.data[0].embedding, floats.data[0].embedding, atol=0)
    raw = httpx.post(
        api.stack.base_url + "/v1/embeddings",
        headers={"Authorization": f"Bearer {api.raw_key}"},
        json={"model": MODEL, "input": "hello world", "encoding_format": "base64"},
        timeout=60,
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.array(floats.data[0].embedding, dtype=np.float32))


def test_dimensions_cut_and_renormalize(api: Embeddings) -> None:
    full = np.array(api.client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding)
    cut = np.array(
        api.client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=128).data[0].embedding
    )
    assert cut.shape == (128,) and abs(np.linalg.norm(cut) - 1) < 1e-5
    assert np.allclose(cut, full[:128] / np.linalg.norm(full[:128]), atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions may be at most 384"):
        api.client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=1000)


def test_token_id_inputs_embed_as_their_text_does(api: Embeddings, reference) -> None:
    ids = reference.tokenizer(TEXTS[1])["input_ids"]
    by_ids = api.client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    by_text = api.client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-6)


def test_a_long_input_is_refused_naming_both_numbers_unless_truncated(api: Embeddings) -> None:
    long = "word " * 600
    with pytest.raises(openai.BadRequestError) as refused:
        api.client.embeddings.create(model=MODEL, input=["short", long])
    message = refused.value.body["message"]
    assert "512" in message and "input 1 has 602 tokens" in message
    assert refused.value.code == "context_length_exceeded"
    cut = api.client.embeddings.create(
        model=MODEL, input=["short", long], extra_body={"truncate_prompt_tokens": 512}
    )
    assert len(cut.data) == 2 and cut.usage.prompt_tokens == 3 + 512


def test_an_embedding_is_billed_and_a_chat_with_the_embedding_model_is_refused(api: Embeddings) -> None:
    raw = api.client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS[:2], user="user-9")
    reply = raw.parse()
    row = wait_until(
        lambda: UsageRecord.objects.filter(request_id=raw.headers["x-request-id"]).first(), timeout=60
    )
    assert (row.prompt_tokens, row.completion_tokens, row.end_user) == (
        reply.usage.prompt_tokens,
        0,
        "user-9",
    )
    with pytest.raises(openai.BadRequestError, match="computes embeddings") as refused:
        api.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "model_task_mismatch"
    assert MODEL in [m.id for m in api.client.models.list().data]


def test_langchains_openai_embeddings_works_against_the_endpoint(api: Embeddings) -> None:
    from langchain_openai import OpenAIEmbeddings

    client = OpenAIEmbeddings(
        model=MODEL,
        base_url=api.stack.base_url + "/v1",
        api_key=api.raw_key,
        check_embedding_ctx_length=False,  # its token counting is tiktoken's, for OpenAI's models
        max_retries=0,
    )
    documents = client.embed_documents(TEXTS[:3])
    query = client.embed_query(TEXTS[0])
    assert [len(d) for d in documents] == [384, 384, 384]
    assert np.allclose(query, documents[0], atol=1e-6)
    direct = api.client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert np.allclose(documents[1], direct.data[0].embedding, atol=1e-6)


def test_the_nearest_passage_to_a_question_is_its_answer(api: Embeddings) -> None:
    passages = [
        "Paris is the capital and largest city of France.",
        "Tulip bulbs should be planted in the autumn, six to eight weeks before frost.",
        "The mitochondria is the powerhouse of the cell.",
        "Mount Everest is the highest mountain above sea level.",
        "Python is a programming language created by Guido van Rossum.",
        "The Great Wall of China is thousands of kilometres long.",
        "Honey bees communicate the location of flowers with a waggle dance.",
        "The Pacific is the largest and deepest ocean on Earth.",
        "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
        "The violin has four strings tuned in perfect fifths.",
        "Marathon races are 42.195 kilometres long.",
        "Jupiter is the largest planet in the Solar System.",
        "Espresso is brewed by forcing hot water through finely ground coffee.",
        "The Rosetta Stone helped scholars decipher Egyptian hieroglyphs.",
        "Penguins live almost exclusively in the Southern Hemisphere.",
        "A haiku has three lines of five, seven and five syllables.",
        "The speed of light in vacuum is about 300,000 kilometres per second.",
        "Bread rises because yeast produces carbon dioxide.",
        "Chess is played on a board of sixty-four squares.",
        "The Amazon rainforest spans nine countries in South America.",
    ]
    questions = {
        "When should I plant tulips?": 1,
        "What is the tallest mountain in the world?": 3,
        "How long is a marathon?": 10,
        "Which planet is the biggest?": 11,
    }
    vectors = np.array([d.embedding for d in api.client.embeddings.create(model=MODEL, input=passages).data])
    asked = api.client.embeddings.create(model=MODEL, input=list(questions)).data
    for (question, answer), vector in zip(questions.items(), asked, strict=True):
        nearest = int(np.argmax(vectors @ np.array(vector.embedding)))
        assert nearest == answer, (question, passages[nearest])
