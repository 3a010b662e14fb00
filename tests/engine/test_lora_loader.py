"""Adapter directories the engine refuses, each with a reason a person can act on, changing nothing."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.lora.errors import LoRALoadError
from engine.lora.loader import load_adapter
from engine.models import load_model_config
from engine.protocol import LoRARef
from engine.sampling_params import SamplingParams
from tests.engine import lora_helpers
from tests.engine.lora_helpers import lora_engine, run_to_completion

WEIGHTS = "adapter_model.safetensors"

adapter_dirs = lora_helpers.adapter_dirs  # the session fixture the LoRA test modules share


class _WritesAFileWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(root: Path, **changes) -> None:
    config = json.loads((root / "adapter_config.json").read_text())
    config.update(changes)
    (root / "adapter_config.json").write_text(json.dumps(config))


def edit_tensors(root: Path, edit) -> None:
    tensors = load_file(str(root / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(root / WEIGHTS))


def refusal(root: Path, tiny_llama_dir: Path, max_rank: int = 16) -> str:
    with pytest.raises(LoRALoadError) as info:
        load_adapter(root, load_model_config(tiny_llama_dir), max_rank=max_rank, dtype=torch.float32)
    return str(info.value)


def test_a_pickled_adapter_is_refused_without_being_unpickled(tiny_llama_dir, adapter_dirs, tmp_path):
    root = copy_adapter(adapter_dirs["r8"], tmp_path / "pickled")
    (root / WEIGHTS).unlink()
    marker = tmp_path / "unpickled"
    (root / "adapter_model.bin").write_bytes(pickle.dumps(_WritesAFileWhenUnpickled(marker)))

    assert "pickled adapter_model.bin files are not loaded" in refusal(root, tiny_llama_dir)
    assert not marker.exists()


def test_a_rank_above_the_engines_limit_is_refused(tiny_llama_dir, adapter_dirs):
    assert "rank 16 exceeds this engine's max_lora_rank 8" in refusal(
        adapter_dirs["r16"], tiny_llama_dir, max_rank=8
    )


def test_tensors_shaped_for_another_model_are_refused(tiny_llama_dir, adapter_dirs, tmp_path):
    root = copy_adapter(adapter_dirs["r8"], tmp_path / "wide")
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    edit_tensors(root, lambda t: t.update({key: torch.zeros(8, 352)}))

    assert refusal(root, tiny_llama_dir).endswith(
        "layer 1 down_proj: lora_A (8, 352) and lora_B (64, 8) do not fit (176 in, 64 out)"
    )


def test_weights_for_modules_the_engine_cannot_adapt_are_refused(tiny_llama_dir, adapter_dirs, tmp_path):
    root = copy_adapter(adapter_dirs["r8"], tmp_path / "embed")
    edit_tensors(
        root,
        lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 2048)}),
    )
    assert "unexpected tensor 'base_model.model.model.embed_tokens.lora_embedding_A'" in refusal(
        root, tiny_llama_dir
    )

    beyond = copy_adapter(adapter_dirs["r8"], tmp_path / "layer9")
    edit_tensors(beyond, lambda t: t.update({
        "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(256, 8),
    }))  # fmt: skip
    assert "names no module of the base model" in refusal(beyond, tiny_llama_dir)


def test_a_lone_a_matrix_is_refused(tiny_llama_dir, adapter_dirs, tmp_path):
    root = copy_adapter(adapter_dirs["r8"], tmp_path / "half")
    edit_tensors(root, lambda t: t.pop("base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"))

    assert refusal(root, tiny_llama_dir).endswith("layer 0 o_proj has lora_B missing")


def test_adapter_options_the_engine_does_not_implement_are_named(tiny_llama_dir, adapter_dirs, tmp_path):
    root = copy_adapter(adapter_dirs["r8"], tmp_path / "dora")
    edit_config(root, use_dora=True, bias="all")

    assert refusal(root, tiny_llama_dir).endswith("unsupported adapter options: use_dora, bias")


def test_missing_and_corrupt_files_are_refused(tiny_llama_dir, adapter_dirs, tmp_path):
    assert "missing adapter_config.json" in refusal(tmp_path, tiny_llama_dir)
    root = copy_adapter(adapter_dirs["r8"], tmp_path / "corrupt")
    (root / WEIGHTS).write_bytes(b"\x00" * 64)
    assert "unreadable safetensors file" in refusal(root, tiny_llama_dir)


def test_a_refused_adapter_leaves_the_engine_as_it_was(tiny_llama_dir, adapter_dirs, tmp_path):
    engine = lora_engine(tiny_llama_dir, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=3)

    with pytest.raises(LoRALoadError, match="max_lora_rank 8"):
        engine.add_request(
            "big", [5, 6, 7], params, tenant="acme", lora=LoRARef("big", str(adapter_dirs["r16"]), "1")
        )

    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert (stats["num_waiting"], stats["num_loras_cached"], stats["num_lora_disk_loads"]) == (0, 0, 0)
    engine.add_request(
        "ok", [5, 6, 7], params, tenant="acme", lora=LoRARef("ok", str(adapter_dirs["r8"]), "1")
    )
    assert len(run_to_completion(engine)["ok"].outputs[0].token_ids) == 3
