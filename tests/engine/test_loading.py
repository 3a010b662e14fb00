"""Model directories in half precision, and malformed ones refused at start with a message naming the fault.

Tolerances in half precision, against transformers in float32 on the same (half-precision) weights,
which float32 represents exactly, so the gap is the engine's arithmetic alone. Logits of the tiny
models stay below 3 in magnitude: float16 keeps 11 significant bits (a rounding step of 2e-3 there),
bfloat16 keeps 8 (1.6e-2); a forward of two layers accumulates a few steps. Observed: 4e-3 and 4e-2.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.llm import LLM
from engine.make_model import make_model
from engine.models import ModelLoadError, load_model, load_model_config
from tests.engine.test_parity import Recorder, _greedy, _prompts

FLOAT16_ATOL = 2e-2
BFLOAT16_ATOL = 1e-1


@pytest.fixture(scope="module")
def float16_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("fp16"), arch="qwen2", size="tiny", seed=2, dtype="float16")


@pytest.fixture(scope="module")
def bfloat16_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("bf16"), arch="llama", size="tiny", seed=3, dtype="bfloat16")


def _max_logit_error(llm: LLM, model_dir: Path, lengths: tuple[int, ...] = (30, 7)) -> float:
    """Largest |engine - transformers float32| over every logit the engine computed."""
    from transformers import AutoModelForCausalLM

    rec = Recorder(llm)
    llm.generate(_prompts(list(lengths), seed=1), _greedy(5))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for items, hidden in rec.steps:
        ours = rec.model.compute_logits(hidden)
        row = 0
        for seq, start, n in items:
            with torch.no_grad():
                ref = hf(torch.tensor([seq.token_ids])).logits[0, start : start + n].float()
            worst = max(worst, (ours[row : row + n] - ref).abs().max().item())
            row += n
    return worst


def test_a_float16_checkpoint_runs_in_float32_on_cpu_and_matches_transformers_exactly(
    float16_qwen2_dir: Path,
) -> None:
    assert load_model_config(float16_qwen2_dir).torch_dtype == "float16"
    llm = LLM(str(float16_qwen2_dir), num_blocks=16)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float32
    rec = Recorder(llm)
    llm.generate(_prompts([30, 7], seed=1), _greedy(5))
    # float16 weights are exact in float32, so this is float32 parity.
    assert rec.check_against(float16_qwen2_dir) == 37 + 2 * 4


def test_float16_on_request_keeps_logits_within_its_tolerance(float16_qwen2_dir: Path) -> None:
    llm = LLM(str(float16_qwen2_dir), num_blocks=16, max_num_batched_tokens=16, dtype="float16")
    assert llm.engine.runner.model.model.embed_tokens.weight.dtype == torch.float16
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float16
    assert _max_logit_error(llm, float16_qwen2_dir) < FLOAT16_ATOL


def test_bfloat16_keeps_logits_within_its_tolerance(bfloat16_llama_dir: Path) -> None:
    llm = LLM(str(bfloat16_llama_dir), num_blocks=16, max_num_batched_tokens=16, dtype="bfloat16")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert _max_logit_error(llm, bfloat16_llama_dir) < BFLOAT16_ATOL


def test_bfloat16_prefill_chunks_multiplied_in_float32_keep_logits_within_its_tolerance(
    bfloat16_llama_dir: Path,
) -> None:
    # given chunks wider than the rows at which bfloat16 linears on CPU switch to float32 GEMMs
    llm = LLM(str(bfloat16_llama_dir), num_blocks=64, max_num_batched_tokens=512, dtype="bfloat16")
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert 300 >= type(qkv).FLOAT32_MIN_ROWS
    # then the logits of the 300-token prefill and the decodes after it stay within tolerance
    assert _max_logit_error(llm, bfloat16_llama_dir, lengths=(300, 7)) < BFLOAT16_ATOL


# -- configs as published checkpoints write them --------------------------------------------------

LLAMA31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
QWEN25_05B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_a_llama31_instruct_config_reads_its_gqa_rope_scaling_and_end_tokens(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B_INSTRUCT))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6})
    )
    cfg = load_model_config(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias) == (32, 8, 128, False)
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == (
        500000.0,
        "llama3",
        8.0,
    )
    assert (cfg.max_model_len, cfg.torch_dtype, cfg.eos_token_ids) == (
        131072,
        "bfloat16",
        [128001, 128008, 128009],
    )


def test_a_qwen25_config_has_qkv_bias_tied_embeddings_and_no_sliding_window(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B_INSTRUCT))
    cfg = load_model_config(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (14, 2, 64)
    assert (cfg.qkv_bias, cfg.tie_word_embeddings, cfg.sliding_window, cfg.rope_scaling) == (
        True,
        True,
        None,
        None,
    )
    assert (cfg.max_model_len, cfg.eos_token_ids) == (32768, [151645])


# -- malformed directories ----------------------------------------------------------------------


def _broken_copy(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


CONFIG_FAULTS = [
    (lambda c: c["rope_parameters"].pop("low_freq_factor"), "rope type 'llama3' needs low_freq_factor"),
    (lambda c: c["rope_parameters"].update(high_freq_factor=1.0), "high_freq_factor must be greater"),
    (lambda c: c.update(rope_parameters="llama3"), "rope_parameters / rope_scaling must be an object"),
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (lambda c: c.update(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (lambda c: c.update(vocab_size=-5), "vocab_size must be a positive integer, got -5"),
    (lambda c: c.pop("hidden_size"), "missing or invalid field.*hidden_size"),
    (lambda c: c.update(architectures="LlamaForCausalLM"), "architectures must be a list of names"),
    (lambda c: c.update(hidden_act="gelu"), "hidden activation 'gelu' is not supported for LlamaForCausalLM"),
    (
        lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
        r"quantized checkpoints \(gptq\)",
    ),
]


def test_a_file_given_as_the_model_directory_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="model directory .*config.json' is not a directory"):
        LLM(str(tiny_llama_dir / "config.json"))


@pytest.mark.parametrize(("edit", "message"), CONFIG_FAULTS)
def test_a_malformed_config_is_refused_before_anything_is_loaded(
    edit: Callable[[dict], None], message: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = _broken_copy(tiny_llama_dir, tmp_path / "m", edit)
    with pytest.raises(ModelLoadError, match=message) as info:
        LLM(str(model_dir))
    assert str(model_dir) in str(info.value)


def test_a_malformed_shard_index_is_refused(tmp_path: Path) -> None:
    sharded = make_model(tmp_path / "sharded", arch="mistral", size="tiny", seed=0, max_shard_size="300KB")
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="malformed index"):
        load_model(sharded, TorchAttentionBackend())


def test_a_corrupt_weights_file_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match="unreadable safetensors file"):
        LLM(str(model_dir))


def test_a_checkpoint_missing_a_tensor_or_with_a_stray_one_is_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_llama_dir / "model.safetensors")
    missing = tmp_path / "missing"
    shutil.copytree(tiny_llama_dir, missing)
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
        missing / "model.safetensors",
    )
    with pytest.raises(ModelLoadError, match="missing or duplicates weights.*layers.1.mlp.gate_up_proj"):
        load_model(missing, TorchAttentionBackend())

    stray = tmp_path / "stray"
    shutil.copytree(tiny_llama_dir, stray)
    save_file({**tensors, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, stray / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(stray, TorchAttentionBackend())


def test_an_unreadable_tokenizer_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer could not be loaded"):
        LLM(str(model_dir))


# -- KV cache sizing ------------------------------------------------------------------------------


def test_on_cpu_the_kv_pool_is_sized_from_the_configured_memory_budget(
    tiny_llama_dir: Path, bfloat16_llama_dir: Path
) -> None:
    # K and V, 2 layers, 16 slots, 2 KV heads of 16 dims, 4 bytes: 8 KiB per block in float32.
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(str(tiny_llama_dir), kv_cache_memory_bytes=12 * per_block + per_block // 2)
    assert llm.engine.get_stats()["num_total_blocks"] == 12
    # Half the bytes per element, twice the blocks from the same budget.
    half = LLM(str(bfloat16_llama_dir), kv_cache_memory_bytes=12 * per_block, dtype="bfloat16")
    assert half.engine.get_stats()["num_total_blocks"] == 24


def test_a_kv_budget_below_one_block_is_refused(tiny_llama_dir: Path) -> None:
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="does not fit a single block"):
        LLM(str(tiny_llama_dir), kv_cache_memory_bytes=1000)


def test_auto_dtype_on_cpu_is_float32_whatever_the_checkpoint_holds():
    from types import SimpleNamespace

    from engine.models.loader import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for held in ("bfloat16", "float16", "float32"):
        assert resolve_dtype("auto", SimpleNamespace(torch_dtype=held), cpu) == torch.float32
    # an explicit choice is kept, and a GPU keeps the checkpoint's dtype
    assert resolve_dtype("bfloat16", SimpleNamespace(torch_dtype="float32"), cpu) == torch.bfloat16
    assert resolve_dtype("auto", SimpleNamespace(torch_dtype="bfloat16"), cuda) == torch.bfloat16


def test_on_cpu_float32_decoder_linears_multiply_every_batch_by_a_packed_weight(tiny_llama_dir: Path) -> None:
    from engine.models.loader import _CpuLinear

    llm = LLM(str(tiny_llama_dir), num_blocks=16)
    model = llm.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, _CpuLinear) and qkv.packed is not None
    assert model.packed_logits_weight is not None
    # float32: packed at every width, prefill chunks included
    assert qkv.packed_max_rows >= 2048 and model.packed_max_rows >= 2048
    logits_weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    for rows in (1, 7, 64, 65, 300):
        x = torch.randn(rows, qkv.in_features)
        torch.testing.assert_close(qkv(x), torch.nn.functional.linear(x, qkv.weight), rtol=1e-5, atol=1e-5)
        hidden = torch.randn(rows, model.config.hidden_size)
        expected = torch.nn.functional.linear(hidden, logits_weight)
        torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)


def test_packed_weight_copies_stay_within_their_memory_budget(tiny_llama_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_PACKED_WEIGHTS", "0")
    llm = LLM(str(tiny_llama_dir), num_blocks=16)
    model = llm.engine.runner.model
    assert model.model.layers[0].mlp.gate_up_proj.packed is None
    assert model.packed_logits_weight is None
