"""The BERT encoder (engine.models.bert) on all-MiniLM-L6-v2: the same embeddings as
sentence-transformers' `encode` for texts of 1 to 512 tokens, inputs packed without padding giving
what each gives alone, and the pooling that a sentence-transformers directory declares."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from engine.models.bert import Pooling, is_encoder, load_encoder, load_pooling, pool
from engine.models.config import ModelLoadError

pytestmark = [pytest.mark.real_model]

WORDS = (
    "river mountain quiet library engine window garden thunder lantern bridge market winter "
    "copper violin harbor meadow signal orbit candle forest ladder puzzle marble desert"
).split()


@pytest.fixture(scope="module")
def encoder(minilm_dir: Path):
    from transformers import AutoTokenizer

    return (
        load_encoder(minilm_dir, dtype=torch.float32, device=torch.device("cpu")),
        AutoTokenizer.from_pretrained(minilm_dir),
        load_pooling(minilm_dir),
    )


def _texts(count: int, seed: int = 0) -> list[str]:
    """Texts from one word to past the 512-token context (cut there), in a mixed order."""
    rng = random.Random(seed)
    sizes = [1, 2, 5, 12, 30, 60, 120, 250, 400, 700]
    return [" ".join(rng.choices(WORDS, k=sizes[i % len(sizes)])) for i in range(count)]


def _embed(encoder, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
    model, tokenizer, pooling = encoder
    ids = [tokenizer(t, truncation=True, max_length=512)["input_ids"] for t in texts]
    lengths = [len(i) for i in ids]
    flat = torch.tensor([token for one in ids for token in one])
    return pool(model(flat, lengths), lengths, pooling), lengths


def test_embeddings_equal_sentence_transformers_on_texts_of_1_to_512_tokens(encoder, minilm_dir) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    reference.max_seq_length = 512
    texts = _texts(100)
    ours, lengths = _embed(encoder, texts)
    theirs = reference.encode(texts, convert_to_tensor=True, batch_size=32)
    assert min(lengths) <= 3 and max(lengths) == 512
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=1)
    assert cosine.min().item() >= 0.99999
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-5)


def test_a_packed_batch_gives_what_each_input_gives_alone(encoder) -> None:
    texts = _texts(12, seed=1)
    together, _ = _embed(encoder, texts)
    alone = torch.cat([_embed(encoder, [text])[0] for text in texts])
    assert torch.allclose(together, alone, atol=1e-5)


def test_the_pooling_is_read_from_the_sentence_transformers_files(minilm_dir: Path, tmp_path: Path) -> None:
    assert load_pooling(minilm_dir) == Pooling(mode="mean", normalize=True)
    assert is_encoder(minilm_dir)
    copy = tmp_path / "model"
    shutil.copytree(minilm_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((copy / "1_Pooling" / "config.json").read_text())
    (copy / "1_Pooling" / "config.json").write_text(
        json.dumps({**config, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True})
    )
    modules = [
        m for m in json.loads((copy / "modules.json").read_text()) if not m["type"].endswith("Normalize")
    ]
    (copy / "modules.json").write_text(json.dumps(modules))
    assert load_pooling(copy) == Pooling(mode="cls", normalize=False)
    (copy / "modules.json").unlink()
    assert load_pooling(copy) == Pooling(mode="mean", normalize=True)  # a bare encoder


def test_pooling_modes_over_a_packed_batch() -> None:
    states = torch.tensor([[1.0, 0.0], [3.0, 4.0], [0.0, 2.0], [5.0, -1.0], [1.0, 1.0]])
    lengths = [2, 3]
    plain = {
        mode: pool(states, lengths, Pooling(mode=mode, normalize=False))
        for mode in ("mean", "cls", "last", "max")
    }
    assert torch.allclose(plain["mean"], torch.tensor([[2.0, 2.0], [2.0, 2.0 / 3.0]]))
    assert plain["cls"].tolist() == [[1.0, 0.0], [0.0, 2.0]]
    assert plain["last"].tolist() == [[3.0, 4.0], [1.0, 1.0]]
    assert plain["max"].tolist() == [[3.0, 4.0], [5.0, 2.0]]
    normalized = pool(states, lengths, Pooling(mode="last"))
    assert torch.allclose(normalized[0], torch.tensor([0.6, 0.8]))


def test_a_checkpoint_without_a_layer_tensor_is_a_clear_error(minilm_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "model"
    shutil.copytree(minilm_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(str(minilm_dir / "model.safetensors"))
    del state["encoder.layer.3.output.dense.bias"]
    save_file(state, str(copy / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"encoder\.layer\.3\.output\.dense\.bias"):
        load_encoder(copy, dtype=torch.float32, device=torch.device("cpu"))
