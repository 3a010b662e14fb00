"""Write GGUF files from small Hugging Face model directories, as llama.cpp's converter lays them out
(Q/K rows reordered for Llama-layout models, dimensions innermost first, Llama 3 rope scaling as a
`rope_freqs` tensor, Phi-3's LongRoPE as `rope_factors_*` tensors, each projection of a layer's
experts stacked into one tensor, Gemma's norm weights plus one and only the fields its converter
writes), so the importer can be checked against the weights it started from."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file

if TYPE_CHECKING:
    from gguf import GGUFWriter

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # llama.cpp's phi3: gate and up rows in one ffn_up
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
# One expert's projection -> the GGUF projection its layer's experts are stacked into.
EXPERT_PARTS = {
    "w1": "ffn_gate",
    "w3": "ffn_up",
    "w2": "ffn_down",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
# Gemma's norms after attention and around the MLP, as llama.cpp names them (its ffn_norm is the
# norm before the MLP).
GEMMA_PARTS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA = ("gemma2", "gemma3")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")


def gguf_name(name: str, arch: str = "llama") -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    parts = LAYER_PARTS | GEMMA_PARTS if arch in GEMMA else LAYER_PARTS
    return f"blk.{layer}.{parts[part]}.{kind}"


def gguf_tensors(
    weights: dict[str, torch.Tensor], *, arch: str = "llama", split_experts: bool = False
) -> dict[str, list[str]]:
    """GGUF name -> the Hugging Face tensors it holds: one, or a layer's experts in order, stacked by
    llama.cpp's converter into blk.N.ffn_*_exps (``split_experts``: one blk.N.ffn_*.E tensor each, as
    files from before 2024 have them)."""
    out: dict[str, list[str]] = {}
    experts: dict[str, dict[int, str]] = {}
    for name in weights:
        m = _EXPERT.match(name)
        if m is None:
            out[gguf_name(name, arch)] = [name]
            continue
        layer, expert, proj = m.group(1), int(m.group(2)), EXPERT_PARTS[m.group(3)]
        if split_experts:
            out[f"blk.{layer}.{proj}.{expert}.weight"] = [name]
        else:
            experts.setdefault(f"blk.{layer}.{proj}_exps.weight", {})[expert] = name
    for merged, by_expert in experts.items():
        out[merged] = [by_expert[e] for e in sorted(by_expert)]
    return out


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows (the importer undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """What llama.cpp writes as rope_freqs for Llama 3 rope scaling, from transformers' own rope init."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model(**config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    theta = cfg.rope_parameters["rope_theta"]
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (base / scaled.double()).float().numpy()


def _phi3_fields(w: GGUFWriter, config: dict, rope: dict, tensors: dict[str, np.ndarray]) -> None:
    """What llama.cpp's converter adds for Phi-3: the original context, the sliding window (0 for
    none), and LongRoPE as two factor tensors and an attention factor it computes itself."""
    context = config["max_position_embeddings"]
    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = context / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)


def _gemma_fields(w: GGUFWriter, config: dict, arch: str, *, layer_pattern: bool) -> None:
    """What llama.cpp's Gemma2Model and Gemma3Model add: the head size, the window, the soft caps
    they have; Gemma 2 no rotary base, Gemma 3 the full layers' base and scaling and the sliding
    layers' base. Neither writes the query scalar or the layer pattern (``layer_pattern``: one flag
    per layer as attention.sliding_window_pattern, as Ollama's own converter writes Gemma 3's)."""
    import gguf

    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(config["sliding_window"])
    else:
        rope = config["rope_parameters"]
        full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
        if "rope_theta" in local:
            w.add_rope_freq_base_swa(local["rope_theta"])
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
        if config.get("sliding_window_pattern") != 1:
            w.add_sliding_window(config["sliding_window"])
    if layer_pattern:
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])


def _tokenizer_fields(w: GGUFWriter, model_dir: Path, config: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t for t in tok["added_tokens"]}
    tokens = [added[i]["content"] if i in added else t for t, i in vocab]
    tokens += [added[i]["content"] for i in sorted(added) if i >= len(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if isinstance(eos, list) and len(eos) > 1:
        w.add_eot_token_id(eos[1])
    if config.get("pad_token_id") is not None:
        w.add_pad_token_id(config["pad_token_id"])
    w.add_chat_template(tok_config["chat_template"])


def _llama_fields(w: GGUFWriter, config: dict, arch: str, rope: dict, tensors: dict[str, np.ndarray]) -> None:
    heads = config["num_attention_heads"]
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(rotary * config["hidden_size"]) // heads)
    if arch == "phi3":  # its converter writes no key_length: head_dim is hidden_size / heads
        _phi3_fields(w, config, rope, tensors)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(config)


def write_gguf(
    model_dir: Path,
    out: Path,
    *,
    arch: str,
    quant: str = "Q8_0",
    extra_tensors: dict[str, np.ndarray] | None = None,
    split_experts: bool = False,
    layer_pattern: bool = False,
    extra_fields: dict[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``out`` from ``model_dir``; return the float32 weights as stored (after quantization),
    by Hugging Face name. ``arch``: the GGUF architecture (Mixtral is ``llama``); ``extra_fields``:
    float32 fields to add, by full key."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = arch in ("llama", "mistral")
    gemma = arch in GEMMA

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    tensors = dict(extra_tensors or {})
    if gemma:
        _gemma_fields(w, config, arch, layer_pattern=layer_pattern)
    else:
        _llama_fields(
            w, config, arch, config.get("rope_parameters") or config.get("rope_scaling") or {}, tensors
        )
    for key, value in (extra_fields or {}).items():
        w.add_float32(key, value)
    _tokenizer_fields(w, model_dir, config)

    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    if gemma:
        weights.pop("lm_head.weight", None)  # the output is the token embedding
    if arch == "gemma3":  # its converter cuts the embedding to the tokenizer's tokens
        tok = json.loads((model_dir / "tokenizer.json").read_text())
        rows = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
        weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:rows]
    stored: dict[str, np.ndarray] = {}
    for name_g, names in gguf_tensors(weights, arch=arch, split_experts=split_experts).items():
        parts = [weights[n].float().numpy() for n in names]
        merged = name_g.endswith("_exps.weight")
        original = np.stack(parts) if merged else parts[0]
        shift = gemma and name_g.endswith("norm.weight")
        if shift:  # Gemma's norms as llama.cpp multiplies by them
            original = original + np.float32(1.0)
        array = original
        if permuted and ".attn_q." in name_g:
            array = permute_rows(original, heads)
        elif permuted and ".attn_k." in name_g:
            array = permute_rows(original, kv_heads)
        # llama.cpp never quantizes the expert routers.
        quantized = array.ndim >= 2 and array.shape[-1] % 32 == 0 and ".ffn_gate_inp." not in name_g
        qtype = Q[quant] if quantized else Q.F32
        w.add_tensor(name_g, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        # Quantization works along rows, so the round trip of the unpermuted rows is what the
        # importer must give back (less Gemma's one again, in float32 as the importer takes it).
        back = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype).reshape(original.shape)
        if shift:
            back = back - np.float32(1.0)
        stored.update(zip(names, back if merged else [back], strict=True))
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
