"""/v1/embeddings without an engine: what is refused before anything is queued (a generation model,
malformed inputs, too many of them, unknown fields), and an encoder directory registered as an
embedding deployment."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from engine.rules import MAX_EMBEDDING_INPUTS, model_task
from inference.models import ModelDeployment
from inference.services import deployment_register

pytestmark = pytest.mark.django_db(transaction=True)


def _post(world, body: dict, raw_key: str | None = None):
    return Client().post(
        "/v1/embeddings", json.dumps(body), content_type="application/json", headers=world.headers(raw_key)
    )


def test_a_generation_model_does_not_embed(world) -> None:
    refused = _post(world, {"model": world.model, "input": "hello"})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("model_task_mismatch", "model")
    assert "does not compute embeddings" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must be a string"),
        ({"input": [["a"]]}, "input", "must be a string"),
        ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", f"at most {MAX_EMBEDDING_INPUTS} inputs"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "valid choice"),
        ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "greater than or equal to 1"),
        ({"input": "x", "temperature": 0}, "temperature", "Unrecognized request argument"),
    ],
)
def test_malformed_bodies_are_refused_by_their_field(world, body: dict, param: str, words: str) -> None:
    refused = _post(world, {"model": world.model, **body})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_another_tenants_model_is_not_found(world) -> None:
    refused = _post(world, {"model": world.model, "input": "x"}, world.raw_key_b)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


@pytest.mark.real_model
def test_an_encoder_directory_registers_as_an_embedding_deployment(minilm_dir, smollm2_dir) -> None:
    embed, _ = deployment_register(name="minilm", model_path=minilm_dir)
    chat, _ = deployment_register(name="smollm2", model_path=smollm2_dir)
    assert (embed.task, embed.max_model_len) == (ModelDeployment.Task.EMBED, 512)
    assert chat.task == ModelDeployment.Task.GENERATE
    assert model_task({"architectures": ["BertModel"]}) == "embed"
    assert model_task({"architectures": ["LlamaForCausalLM"]}) == "generate"
    with pytest.raises(ValueError, match="not supported"):
        model_task({"architectures": ["T5ForConditionalGeneration"]})


@pytest.mark.real_model
def test_adapters_are_for_generation_models(world, minilm_dir) -> None:
    from core.errors import InvalidRequestError
    from inference.services.adapters import _base_deployment

    deployment_register(name="minilm-base", model_path=minilm_dir)
    with pytest.raises(InvalidRequestError, match="LoRA adapters apply to generation models") as refused:
        _base_deployment(base_model="minilm-base", allowed_models=None)
    assert refused.value.code == "model_task_mismatch"
    assert _base_deployment(base_model=world.model, allowed_models=None).name == world.model
