"""Write GGUF files from small Hugging Face model directories, as llama.cpp's converter lays them out
(Q/K rows reordered for Llama-layout models, dimensions innermost first, Llama 3 rope scaling as a
`rope_freqs` tensor), so the importer can be checked against the weights it started from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

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
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


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


def write_gguf(
    model_dir: Path,
    out: Path,
    *,
    arch: str,
    quant: str = "Q8_0",
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``out`` from ``model_dir``; return the float32 weights as stored (after quantization)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = arch in ("llama", "mistral")

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
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
    w.add_chat_template(tok_config["chat_template"])

    weights = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    stored: dict[str, np.ndarray] = {}
    tensors = dict(extra_tensors or {})
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(config)
    for name, tensor in weights.items():
        original = tensor.float().numpy()
        name_g = gguf_name(name)
        array = original
        if permuted and ".attn_q." in name_g:
            array = permute_rows(original, heads)
        elif permuted and ".attn_k." in name_g:
            array = permute_rows(original, kv_heads)
        qtype = Q[quant] if array.ndim == 2 and array.shape[-1] % 32 == 0 else Q.F32
        w.add_tensor(name_g, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        # Quantization works along rows, so the round trip of the unpermuted rows is what the
        # importer must give back.
        stored[name] = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype).reshape(
            original.shape
        )
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
