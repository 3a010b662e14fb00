"""A GGUF file's metadata read as the Hugging Face config.json and generation_config.json it stands for.

GGUF (llama.cpp's format, also what Ollama stores) keeps the hyper-parameters as typed key/value
fields named `<architecture>.<key>`, the tokenizer under `tokenizer.ggml.*` and the chat template
under `tokenizer.chat_template`. The engine serves the Llama decoder layout; GGUF names its
checkpoints `llama` (Llama 1-3, Mistral as llama.cpp converts it, and Mixtral: a `llama` file with
an expert count), `mistral`, `qwen2`, `qwen3` (whose per-head q and k norms are the tensors
`attn_q_norm` and `attn_k_norm`), `qwen3moe` (Qwen3 with a mixture of experts), `phi3` (Phi-3 and
Phi-4-mini: fused projections, a partial rotary embedding and LongRoPE), and `gemma2` and `gemma3`
(text only: sliding-window layers, soft caps and the fields llama.cpp assumes rather than stores,
engine.gguf.gemma).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from engine.gguf.fields import GGUFImportError, field_value, int_field
from engine.gguf.gemma import GEMMA_ARCHITECTURES, gemma_fields
from engine.gguf.rope import partial_rotary_factor, rope_scaling

# The GGUF architectures this importer reads.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")
# Model family (a GGUF architecture, or mixtral: a llama file with experts) -> (Hugging Face
# architecture, model_type, Q/K rows permuted by llama.cpp). llama.cpp's converter reorders the rows
# of q_proj and k_proj of Llama-layout models for its interleaved rotary embedding; the others keep
# the Hugging Face (neox) order.
FAMILIES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "mixtral": ("MixtralForCausalLM", "mixtral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
}
_ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")


def architecture(reader: Any) -> str:
    """The file's GGUF architecture, the prefix of its model fields."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def family(reader: Any) -> str:
    """The key of FAMILIES: the architecture, except that llama.cpp converts Mixtral as `llama`
    and tells it apart only by its expert count."""
    arch = architecture(reader)
    if arch == "llama" and field_value(reader, "llama.expert_count", 0) > 0:
        return "mixtral"
    return arch


def _experts(reader: Any, arch: str, fam: str) -> dict[str, Any]:
    """The mixture-of-experts fields of config.json; {} for a dense model. llama.cpp's qwen3moe
    always renormalises the chosen experts' weights (expert_weights_norm, where a file states it,
    says otherwise); its Mixtral does as Mixtral does. A qwen3moe layer with an MLP in place of the
    router is one of Qwen3-MoE's mlp_only_layers."""
    if fam not in ("mixtral", "qwen3moe"):
        return {}
    count = int_field(reader, f"{arch}.expert_count")
    used = int_field(reader, f"{arch}.expert_used_count")
    if fam == "mixtral":
        return {"num_local_experts": count, "num_experts_per_tok": used}
    routed = {int(m.group(1)) for t in reader.tensors if (m := _ROUTER.match(t.name))}
    return {
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int_field(reader, f"{arch}.expert_feed_forward_length"),
        "norm_topk_prob": bool(field_value(reader, f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(int_field(reader, f"{arch}.block_count")) if i not in routed],
    }


def _phi3(reader: Any, arch: str) -> dict[str, Any]:
    """Phi-3's own fields: the pre-training context (LongRoPE's switch from short to long factors)
    and the sliding window, which llama.cpp's converter writes as 0 where the model has none."""
    out: dict[str, Any] = {"sliding_window": field_value(reader, f"{arch}.attention.sliding_window") or None}
    original = f"{arch}.rope.scaling.original_context_length"
    if original in reader.fields:
        out["original_max_position_embeddings"] = int_field(reader, original)
    return out


def hf_config(
    reader: Any, *, dtype: str, vocab_size: int, tied: bool, rope_tensors: dict[str, np.ndarray]
) -> dict:
    """config.json for the engine's loader and for transformers, from the GGUF's metadata.
    `rope_tensors`: the file's tensors that are rope scaling (engine.gguf.rope.ROPE_TENSORS)."""
    arch, fam = architecture(reader), family(reader)
    hf_arch, model_type, _ = FAMILIES[fam]
    hidden = int_field(reader, f"{arch}.embedding_length")
    heads = int_field(reader, f"{arch}.attention.head_count")
    head_dim = int_field(reader, f"{arch}.attention.key_length", hidden // heads)
    theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    rotary_dim = int_field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim and fam != "phi3":
        raise GGUFImportError(f"partial rotary embedding ({rotary_dim} of {head_dim} dims) is not supported")
    ids = special_token_ids(reader)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int_field(
            reader, f"{arch}.feed_forward_length", field_value(reader, f"{arch}.expert_feed_forward_length")
        ),
        "num_hidden_layers": int_field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int_field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling(reader, arch, rotary_dim, theta, rope_tensors),
        "max_position_embeddings": int_field(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": tied,
        "attention_bias": arch == "qwen2",
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
        # Stated even when absent: transformers' Phi3Config otherwise takes Phi-3's 32000, beyond
        # a smaller vocabulary (its embedding refuses a padding index past the end).
        "pad_token_id": ids.get("pad"),
        "torch_dtype": dtype,
        **_experts(reader, arch, fam),
    }
    if rotary_dim != head_dim:
        config["partial_rotary_factor"] = partial_rotary_factor(rotary_dim, head_dim)
    if fam == "phi3":
        config.update(_phi3(reader, arch))
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if fam in ("mistral", "mixtral"):
        config["sliding_window"] = None
    if fam in GEMMA_ARCHITECTURES:
        layers = config["num_hidden_layers"]
        config.update(
            gemma_fields(
                reader, arch, layers=layers, hidden=hidden, heads=heads, head_dim=head_dim, theta=theta
            )
        )
    return config


def special_token_ids(reader: Any) -> dict[str, int]:
    names = {
        "bos": "bos_token_id",
        "eos": "eos_token_id",
        "eot": "eot_token_id",
        "eom": "eom_token_id",
        "pad": "padding_token_id",
    }
    out = {}
    for short, key in names.items():
        value = field_value(reader, f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            out[short] = value
    return out


def generation_config(reader: Any) -> dict:
    """generation_config.json: what generation stops on (end of text, end of turn, end of message)."""
    ids = special_token_ids(reader)
    stops = list(dict.fromkeys(ids[k] for k in ("eos", "eot", "eom") if k in ids))
    config: dict[str, Any] = {
        "bos_token_id": ids.get("bos"),
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
    }
    if "pad" in ids:
        config["pad_token_id"] = ids["pad"]
    return config
