"""The model builder writes complete, deterministic Hugging Face directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from engine.make_model import BOS, EOT, make_model

ROOT = Path(__file__).resolve().parents[2]


def test_cli_writes_a_complete_model_directory(tmp_path: Path) -> None:
    out = tmp_path / "qwen"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "make-model",
            "--arch",
            "qwen2",
            "--size",
            "tiny",
            "--out",
            str(out),
            "--seed",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (2, 64, 4, 2)
    assert "model.layers.0.self_attn.q_proj.bias" in load_file(out / "model.safetensors")


def test_same_seed_gives_the_same_weights_and_another_seed_does_not(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    again = load_file(make_model(tmp_path / "a", arch="llama", seed=0) / "model.safetensors")
    other = load_file(make_model(tmp_path / "b", arch="llama", seed=1) / "model.safetensors")
    base = load_file(tiny_llama_dir / "model.safetensors")
    assert all((again[k] == base[k]).all() for k in base)
    assert not (other["model.embed_tokens.weight"] == base["model.embed_tokens.weight"]).all()


def test_tokenizer_has_special_tokens_chat_template_and_round_trips(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    assert len(tok) == 2048
    ids = tok.encode("def héllo(x): return '日本' + x")
    assert ids[0] == tok.convert_tokens_to_ids(BOS)
    assert tok.decode(ids, skip_special_tokens=True) == "def héllo(x): return '日本' + x"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert (
        chat
        == f"{BOS}<|start_header_id|>user<|end_header_id|>\n\nhi{EOT}<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_generation_config_lists_both_end_tokens(tiny_mistral_dir: Path) -> None:
    gen = json.loads((tiny_mistral_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 2]
    config = json.loads((tiny_mistral_dir / "config.json").read_text())
    assert config["sliding_window"] is None and config["architectures"] == ["MistralForCausalLM"]
