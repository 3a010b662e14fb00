"""Loading model directories: what is accepted (sharded, tied, bfloat16) and what is refused, and why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.llm import LLM
from engine.make_model import make_model
from engine.models import ModelLoadError, UnsupportedModelError, load_model, load_model_config
from engine.models.rope import rope_inv_freq
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import Recorder, _greedy, _prompts


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: Path, **changes) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def test_config_reads_gqa_rope_scaling_and_eos_ids(tiny_llama_dir: Path) -> None:
    cfg = load_model_config(tiny_llama_dir)
    assert (cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("LlamaForCausalLM", 4, 2, 16)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_theta == 500000.0
    assert cfg.eos_token_ids == [1, 2]  # <|end_of_text|>, <|eot_id|> from generation_config.json


def test_qwen2_has_qkv_bias_and_mistral_has_none(tiny_qwen2_dir: Path, tiny_mistral_dir: Path) -> None:
    assert load_model_config(tiny_qwen2_dir).qkv_bias is True
    assert load_model_config(tiny_mistral_dir).qkv_bias is False


def test_llama3_rope_frequencies_equal_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_cfg = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=scaling
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), expected, atol=0, rtol=1e-6)


def test_legacy_rope_theta_and_rope_scaling_keys_are_read(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((model_dir / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params  # the layout of every Llama 3.1 checkpoint on the hub
    (model_dir / "config.json").write_text(json.dumps(cfg))
    loaded = load_model_config(model_dir)
    assert loaded.rope_theta == 500000.0 and loaded.rope_scaling["factor"] == 8.0


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing config.json"):
        LLM(str(tmp_path))


def test_unparseable_config_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path / "m")
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM(str(model_dir))


def test_unsupported_architecture_is_refused_with_its_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(model_dir))


def test_unsupported_rope_type_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(model_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model_config(model_dir)


def test_missing_weights_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(model_dir))


def test_weights_that_disagree_with_config_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(model_dir, intermediate_size=200)
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(model_dir, TorchAttentionBackend())


def test_missing_tokenizer_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_llama_dir, tmp_path / "m")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        LLM(str(model_dir))


def test_sharded_checkpoint_loads_the_same_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    sharded = make_model(tmp_path / "sharded", arch="llama", size="tiny", seed=0, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    single = load_model(tiny_llama_dir, TorchAttentionBackend()).state_dict()
    for name, tensor in load_model(sharded, TorchAttentionBackend()).state_dict().items():
        assert torch.equal(tensor, single[name]), name


def test_missing_shard_is_refused(tmp_path: Path) -> None:
    sharded = make_model(tmp_path / "sharded", arch="llama", size="tiny", seed=0, max_shard_size="300KB")
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    with pytest.raises(ModelLoadError, match="shards listed in the index are missing"):
        load_model(sharded, TorchAttentionBackend())


def test_tied_embeddings_share_the_input_matrix_and_match_transformers(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "tied", arch="qwen2", size="tiny", seed=1, tie_word_embeddings=True)
    llm = LLM(str(model_dir), num_blocks=32)
    assert llm.engine.runner.model.lm_head is None
    rec = Recorder(llm)
    llm.generate(_prompts([9, 20]), _greedy(5))
    assert rec.check_against(model_dir) == 29 + 2 * 4


def test_bfloat16_checkpoint_loads_and_generates(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "bf16", arch="llama", size="tiny", seed=0, dtype="bfloat16")
    llm = LLM(str(model_dir), num_blocks=32, dtype="bfloat16")
    assert llm.engine.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    out = llm.generate([[0, 100, 200, 300]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[
        0
    ]
    assert len(out.outputs[0].token_ids) == 6
    # The first token is a single prefill forward; it must agree with transformers in bfloat16.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert (
            out.outputs[0].token_ids[0]
            == hf(torch.tensor([[0, 100, 200, 300]])).logits[0, -1].argmax().item()
        )


def test_float32_override_of_a_bfloat16_checkpoint(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "bf16", arch="mistral", size="tiny", seed=0, dtype="bfloat16")
    model = load_model(model_dir, TorchAttentionBackend(), dtype="float32")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
