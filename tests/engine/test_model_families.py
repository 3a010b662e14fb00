"""Phi-3/4 (LongRoPE, partial rotary, fused checkpoints) and the mixtures of experts (Mixtral,
Qwen3-MoE): what the shared parity tests (test_parity.py) do not reach.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.torch_backend import TorchAttentionBackend
from engine.llm import LLM
from engine.lora.errors import LoRALoadError
from engine.lora.loader import load_adapter
from engine.models import ModelLoadError, load_model, load_model_config
from engine.models.moe import SparseMoeBlock, route
from engine.protocol import LoRARef
from engine.sampling_params import SamplingParams
from tests.engine.lora_helpers import lora_engine, make_peft_adapter, prompts, run_to_completion
from tests.engine.test_lora_parity import SampledLogits
from tests.engine.test_parity import Recorder
from tests.kernels.helpers import DEVICES, assert_close


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            raw[key] = {**raw.get(key, {}), **value}
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


# --- Phi-3 / Phi-4-mini -------------------------------------------------------------------------------


def test_phi3_config_reads_longrope_and_the_partial_rotary_embedding(tiny_phi3_dir: Path) -> None:
    cfg = load_model_config(tiny_phi3_dir)
    assert cfg.architecture == "Phi3ForCausalLM"
    assert cfg.rotary_dims == cfg.head_dim * 3 // 4 and cfg.rotary_dim is not None
    scaling = cfg.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == cfg.rotary_dims // 2
    # The whole context is the pre-training one: no attention factor.
    assert scaling["attention_factor"] == 1.0


def test_longrope_long_factors_past_the_original_context_match_transformers(
    tiny_phi3_dir: Path, tmp_path: Path
) -> None:
    """A context beyond original_max_position_embeddings takes the long factors and the attention
    factor sqrt(1 + ln(s) / ln(original)), as transformers does for a sequence that long."""
    model_dir = _edit_config(
        tiny_phi3_dir,
        tmp_path / "phi3-long",
        original_max_position_embeddings=48,
        rope_parameters={"original_max_position_embeddings": 48},
    )
    scaling = load_model_config(model_dir).rope_scaling
    assert scaling is not None and scaling["attention_factor"] > 1.0
    llm = LLM(str(model_dir), num_blocks=64)
    assert llm.engine.runner.model.long_rope
    rec = Recorder(llm)
    # Every sequence is longer than 48 tokens once its prompt is in: transformers' forward over it
    # takes the long factors for every position too.
    outs = llm.generate(prompts([60, 75, 90], seed=5), _greedy(6))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert rec.check_against(model_dir) == 60 + 75 + 90 + 3 * 5


def test_longrope_short_factors_serve_a_context_within_the_original(
    tiny_phi3_dir: Path, tmp_path: Path
) -> None:
    """Served with max_model_len within the original context, the model takes the short factors,
    as transformers does for sequences that short; the two tables give different logits."""
    model_dir = _edit_config(
        tiny_phi3_dir,
        tmp_path / "phi3-short",
        original_max_position_embeddings=48,
        rope_parameters={"original_max_position_embeddings": 48},
    )
    short = LLM(str(model_dir), num_blocks=16, max_model_len=48)
    assert not short.engine.runner.model.long_rope
    rec = Recorder(short)
    prompt = prompts([30], seed=6)[0]
    short.generate([prompt], _greedy(10))
    rec.check_against(model_dir)
    long = LLM(str(model_dir), num_blocks=16)
    long_rec = Recorder(long)
    long.generate([prompt], _greedy(1))
    first_short = short.engine.runner.model.compute_logits(rec.steps[0][1])
    first_long = long.engine.runner.model.compute_logits(long_rec.steps[0][1])
    assert (first_short - first_long).abs().max().item() > 1e-2


def test_longrope_factors_of_the_wrong_length_are_refused(tiny_phi3_dir: Path, tmp_path: Path) -> None:
    model_dir = _edit_config(tiny_phi3_dir, tmp_path / "bad", rope_parameters={"short_factor": [1.0, 1.0]})
    with pytest.raises(ModelLoadError, match="short_factor must be a list of"):
        load_model_config(model_dir)


def _served_under_the_adapter_as_peft_computes(
    model_dir: Path, adapter: Path, lengths: list[int], max_tokens: int
) -> int:
    """Greedy requests of these prompt lengths under the adapter, every sampled row checked
    against PEFT; how many rows were compared."""
    engine = lora_engine(model_dir)
    recorder = SampledLogits(engine)
    for i, prompt in enumerate(prompts(lengths, seed=len(lengths) + max_tokens)):
        lora = LoRARef("adapter", str(adapter), "1")
        engine.add_request(f"r{i}", prompt, _greedy(max_tokens), tenant="acme", lora=lora)
    final = run_to_completion(engine)
    assert all(len(out.outputs[0].token_ids) == max_tokens for out in final.values())
    seqs = {seq.seq_id for seq, _, _ in recorder.rows}
    return recorder.check_against(model_dir, dict.fromkeys(seqs, adapter))


def test_a_phi3_adapter_on_the_fused_projections_matches_peft(tiny_phi3_dir: Path, tmp_path: Path) -> None:
    """PEFT adapts Phi-3's fused qkv_proj and gate_up_proj as single modules; the engine serves them
    as their parts' LoRA with one A between them."""
    adapter = make_peft_adapter(
        tiny_phi3_dir,
        tmp_path / "phi3-lora",
        rank=8,
        alpha=16,
        targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        seed=11,
    )
    assert _served_under_the_adapter_as_peft_computes(tiny_phi3_dir, adapter, [7, 33], 10) == 2 * 10


def test_an_adapter_naming_a_fused_module_and_its_part_is_refused(
    tiny_phi3_dir: Path, tmp_path: Path
) -> None:
    adapter = make_peft_adapter(
        tiny_phi3_dir, tmp_path / "lora", rank=4, alpha=8, targets=("qkv_proj",), seed=1
    )
    cfg = load_model_config(tiny_phi3_dir)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn."
    tensors[prefix + "v_proj.lora_A.weight"] = torch.zeros(4, cfg.hidden_size)
    tensors[prefix + "v_proj.lora_B.weight"] = torch.zeros(cfg.num_kv_heads * cfg.head_dim, 4)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(LoRALoadError, match="v_proj is also adapted on its own"):
        load_adapter(adapter, cfg, max_rank=16, dtype=torch.float32)


# --- Mixture of experts -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["tiny_mixtral_dir", "tiny_qwen3moe_dir"])
def test_the_grouped_experts_equal_the_dense_reference_at_batch_64(arch: str, request) -> None:
    model_dir = request.getfixturevalue(arch)
    model = load_model(model_dir, TorchAttentionBackend())
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for block in blocks:
        weights, experts = route(block.gate(x), block.top_k, block.renormalize)
        assert len(set(experts.reshape(-1).tolist())) == block.num_experts  # every expert has tokens
        with torch.inference_mode():
            torch.testing.assert_close(
                block.grouped(x, weights, experts), block.dense(x, weights, experts), atol=1e-5, rtol=0
            )
        if block.renormalize:
            torch.testing.assert_close(weights.sum(-1), torch.ones(64))


@pytest.mark.parametrize("device", DEVICES)
def test_the_experts_block_through_the_triton_kernel_equals_its_torch_path(device, tiny_mixtral_dir):
    model = load_model(tiny_mixtral_dir, TorchAttentionBackend(), device=device)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        weights, experts = route(block.gate(x), block.top_k, block.renormalize)
        block.use_kernel = True
        through_kernel = block.grouped(x, weights, experts)
        block.use_kernel = False
        torch_path = block.grouped(x, weights, experts)
    assert_close(through_kernel, torch_path, torch.float32)
    assert_close(through_kernel, block.dense(x, weights, experts), torch.float32)


def test_on_a_gpu_small_experts_take_the_grouped_kernel_and_large_ones_a_multiply_each() -> None:
    """The rule bench/moe_experts.py measured on an H100 (SparseMoeBlock.KERNEL_MAX_EXPERT_WEIGHTS)."""
    from types import SimpleNamespace

    def block(hidden: int, inter: int, experts: int) -> SparseMoeBlock:
        cfg = SimpleNamespace(
            hidden_size=hidden, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=inter,
            norm_topk_prob=True,
        )  # fmt: skip
        with torch.device("meta"):
            return SparseMoeBlock(cfg)  # type: ignore[arg-type]

    assert not block(4096, 14336, 8).kernel_suits()  # Mixtral-8x7B
    assert block(2048, 768, 128).kernel_suits()  # Qwen3-30B-A3B
    assert block(512, 1408, 8).kernel_suits()  # the bench model


def test_qwen3moe_keeps_dense_mlps_where_the_config_says(tiny_qwen3moe_dir: Path) -> None:
    cfg = load_model_config(tiny_qwen3moe_dir)
    assert cfg.moe_layers == tuple(range(1, cfg.num_layers)) and cfg.qk_norm and cfg.norm_topk_prob
    model = load_model(tiny_qwen3moe_dir, TorchAttentionBackend())
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP"] + ["SparseMoeBlock"] * (cfg.num_layers - 1)


def test_experts_held_as_one_tensor_each_load_the_same(tiny_mixtral_dir: Path, tmp_path: Path) -> None:
    """transformers 5 holds a layer's experts as (experts, 2 * inter, hidden) and (experts, hidden,
    inter) tensors; a checkpoint saved that way loads to the same parameters."""
    dst = tmp_path / "mixtral-3d"
    shutil.copytree(tiny_mixtral_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    cfg = load_model_config(dst)
    for layer in range(cfg.num_layers):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts."
        w1, w2, w3 = (
            [tensors.pop(f"{prefix}{e}.{w}.weight") for e in range(cfg.num_experts)]
            for w in ("w1", "w2", "w3")
        )
        tensors[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w1, w3, strict=True)]
        )
        tensors[prefix + "down_proj"] = torch.stack(w2)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(dst, TorchAttentionBackend()).state_dict()
    reference = load_model(tiny_mixtral_dir, TorchAttentionBackend()).state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


def test_a_missing_expert_is_refused(tiny_mixtral_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "mixtral-missing"
    shutil.copytree(tiny_mixtral_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"missing or duplicates weights for \['model.layers.1.mlp.w13'\]"
    ):
        load_model(dst, TorchAttentionBackend())


def test_more_experts_per_token_than_experts_is_refused(tiny_mixtral_dir: Path, tmp_path: Path) -> None:
    model_dir = _edit_config(tiny_mixtral_dir, tmp_path / "bad", num_experts_per_tok=9)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        load_model_config(model_dir)


def test_an_adapter_on_qwen3moe_attention_matches_peft_and_one_on_its_experts_is_refused(
    tiny_qwen3moe_dir: Path, tmp_path: Path
) -> None:
    adapter = make_peft_adapter(
        tiny_qwen3moe_dir,
        tmp_path / "attn",
        rank=8,
        alpha=16,
        targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        seed=4,
    )
    assert _served_under_the_adapter_as_peft_computes(tiny_qwen3moe_dir, adapter, [9, 40], 8) == 2 * 8
    # PEFT adapts the experts' own tensors (target_parameters), which the engine does not serve.
    experts = make_peft_adapter(
        tiny_qwen3moe_dir, tmp_path / "experts", rank=4, alpha=8, targets=("down_proj",)
    )
    cfg = load_model_config(tiny_qwen3moe_dir)
    with pytest.raises(LoRALoadError, match="target_parameters"):
        load_adapter(experts, cfg, max_rank=16, dtype=torch.float32)
    # The dense first layer's MLP may carry an adapter; a sparse layer's may not.
    mlp = tmp_path / "mlp"
    shutil.copytree(adapter, mlp)
    tensors = load_file(str(mlp / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for layer in (0, 1):
        for ab, shape in (("A", (8, cfg.intermediate_size)), ("B", (cfg.hidden_size, 8))):
            name = f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_{ab}.weight"
            tensors[name] = torch.randn(shape, generator=gen)
        save_file(tensors, str(mlp / "adapter_model.safetensors"))
        if layer == 0:
            loaded = load_adapter(mlp, cfg, max_rank=16, dtype=torch.float32)
            assert (0, "down_proj") in loaded.weights
    with pytest.raises(LoRALoadError, match="layer 1's MLP is a mixture of experts"):
        load_adapter(mlp, cfg, max_rank=16, dtype=torch.float32)


def test_moe_serves_with_chunked_prefill_and_prefix_cache_hits_like_transformers(
    tiny_mixtral_dir: Path,
) -> None:
    llm = LLM(str(tiny_mixtral_dir), num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    rec = Recorder(llm)
    shared = prompts([40], seed=8)[0]
    llm.generate([shared + [7]], _greedy(3))
    later = llm.generate([shared + [9, 10], shared + [11]], _greedy(4))
    assert [o.num_cached_tokens for o in later] == [32, 32]
    rec.check_against(tiny_mixtral_dir)


def test_the_upload_checks_take_phi3_fused_targets_and_refuse_adapted_experts(
    tiny_phi3_dir: Path, tiny_qwen3moe_dir: Path, tmp_path: Path
) -> None:
    """The web tier's checks of an uploaded adapter read the same rules as the engine's loader."""
    from inference.services.adapter_checks import AdapterInvalid, adapter_check

    fused = make_peft_adapter(
        tiny_phi3_dir, tmp_path / "phi3", rank=4, alpha=8, targets=("qkv_proj", "gate_up_proj"), seed=2
    )
    spec = adapter_check(adapter_dir=fused, model_path=str(tiny_phi3_dir), base_name="phi", max_rank=16)
    assert spec.target_modules == ["qkv_proj", "gate_up_proj"]
    attn = make_peft_adapter(
        tiny_qwen3moe_dir, tmp_path / "moe", rank=4, alpha=8, targets=("o_proj",), seed=3
    )
    assert adapter_check(adapter_dir=attn, model_path=str(tiny_qwen3moe_dir), base_name="moe", max_rank=16)
    cfg = load_model_config(tiny_qwen3moe_dir)
    tensors = load_file(str(attn / "adapter_model.safetensors"))
    for ab, shape in (("A", (4, cfg.intermediate_size)), ("B", (cfg.hidden_size, 4))):
        tensors[f"base_model.model.model.layers.1.mlp.down_proj.lora_{ab}.weight"] = torch.zeros(shape)
    save_file(tensors, str(attn / "adapter_model.safetensors"))
    raw = json.loads((attn / "adapter_config.json").read_text())
    (attn / "adapter_config.json").write_text(json.dumps({**raw, "target_modules": ["o_proj", "down_proj"]}))
    with pytest.raises(
        AdapterInvalid, match="layer 1, which in the base model `moe` is a\\s+mixture of experts"
    ):
        adapter_check(adapter_dir=attn, model_path=str(tiny_qwen3moe_dir), base_name="moe", max_rank=16)


# --- Gemma 2 / Gemma 3 --------------------------------------------------------------------------------


def test_gemma_configs_read_windows_caps_and_rope_bases(tiny_gemma2_dir: Path, tiny_gemma3_dir: Path) -> None:
    g2, g3 = load_model_config(tiny_gemma2_dir), load_model_config(tiny_gemma3_dir)
    assert g2.layer_windows == (32, None) and g3.layer_windows == (32, None)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (5.0, 8.0)
    assert g3.attn_logit_softcap is None and g3.final_logit_softcap is None and g3.qk_norm
    assert g2.attention_scale == pytest.approx(32**-0.5) and g2.tie_word_embeddings
    assert g3.local_rope_theta == 10000.0 and g3.rope_theta == 1000000.0
    assert g3.rope_scaling == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    # The windows are per layer: the context is the model's, not the window.
    assert g2.sliding_window is None and g2.max_model_len == 2048


def test_a_hub_style_gemma3_config_reads_as_transformers_does(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """Configs on the hub give sliding_window_pattern, rope_local_base_freq and rope_scaling rather
    than layer_types and per-type rope_parameters."""
    raw = json.loads((tiny_gemma3_dir / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw.update(
        num_hidden_layers=12,
        sliding_window_pattern=6,
        rope_local_base_freq=20000.0,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(tmp_path)
    assert [w is None for w in cfg.layer_windows] == [(i + 1) % 6 == 0 for i in range(12)]
    assert (cfg.local_rope_theta, cfg.rope_theta) == (20000.0, 500000.0)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 4.0


def test_an_embedding_gemma_and_an_unknown_activation_are_refused(
    tiny_gemma2_dir: Path, tmp_path: Path
) -> None:
    from engine.models import UnsupportedModelError
    from engine.rules import model_tasks

    raw = json.loads((tiny_gemma2_dir / "config.json").read_text())
    assert model_tasks(raw) == ("generate",)
    bidirectional = _edit_config(tiny_gemma2_dir, tmp_path / "bi", use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        load_model_config(bidirectional)
    relu = _edit_config(tiny_gemma2_dir, tmp_path / "relu", hidden_activation="relu", hidden_act="relu")
    with pytest.raises(UnsupportedModelError, match="'relu' is not supported for Gemma2ForCausalLM"):
        load_model_config(relu)


@pytest.mark.parametrize("arch", ["tiny_gemma2_dir", "tiny_gemma3_dir"])
def test_gemma_through_the_triton_kernels_backend_matches_transformers(arch: str, request) -> None:
    """The Triton backend (here under its interpreter) hands windowed and soft-capped layers to the
    same exact attention; the full layers take its kernels."""
    model_dir = request.getfixturevalue(arch)
    llm = LLM(str(model_dir), num_blocks=32, attention_backend="triton", max_num_batched_tokens=24)
    rec = Recorder(llm)
    outs = llm.generate(prompts([40, 9], seed=21), _greedy(4))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    rec.check_against(model_dir)


def test_no_cuda_graphs_are_captured_for_gemma_or_experts(
    tiny_llama_dir: Path, tiny_gemma3_dir: Path, tiny_mixtral_dir: Path
) -> None:
    from engine.engine_setup import graph_capturable

    assert graph_capturable(load_model_config(tiny_llama_dir))
    assert not graph_capturable(load_model_config(tiny_gemma3_dir))
    assert not graph_capturable(load_model_config(tiny_mixtral_dir))
