"""Build small Hugging Face model directories with seeded random weights and a locally trained tokenizer.

No model hub is reachable where the platform is tested, so test, benchmark and demo models are made here.
The weights come from transformers' own model classes and are saved with ``save_pretrained`` exactly as a
real checkpoint is, so the engine reads them through the same path that serves a downloaded model.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, EOT, "<|start_header_id|>", "<|end_header_id|>", "<|pad|>"]

# Llama-3 layout: a header per turn, each turn closed by <|eot_id|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3")

# The mixture-of-experts shapes: experts per layer, experts per token.
MOE_EXPERTS, MOE_TOP_K = 8, 2


@dataclass(frozen=True, slots=True)
class ModelSize:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int


SIZES = {
    "tiny": ModelSize(2048, 64, 2, 4, 2, 176, 2048),
    "small": ModelSize(4096, 256, 4, 8, 4, 704, 4096),
    "bench": ModelSize(8192, 512, 8, 8, 4, 1408, 4096),
}


def _cache_dir() -> Path:
    return Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))


def _training_files() -> list[str]:
    # The interpreter's own standard library is on every machine; sorted for a deterministic corpus.
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained on stdlib sources; cached on disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    files = _training_files()
    digest = hashlib.sha256(
        "\n".join([str(vocab_size), *SPECIAL_TOKENS, *map(os.path.basename, files)]).encode()
    )
    cached = _cache_dir() / f"tokenizer-{vocab_size}-{digest.hexdigest()[:16]}.json"
    if cached.exists():
        return Tokenizer.from_file(str(cached))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama 3 prepends <|begin_of_text|> when special tokens are requested.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, cached)  # atomic: parallel builders never read a half-written file
    return tok


_ROPE_1M = {"rope_type": "default", "rope_theta": 1000000.0}


def _hf_config(arch: str, size: ModelSize, vocab_size: int, tie: bool, dtype: str, ids: dict[str, int]):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        intermediate_size=size.intermediate_size,
        max_position_embeddings=size.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=ids["bos"],
        eos_token_id=[ids["eos"], ids["eot"]],
        pad_token_id=ids["pad"],
        # Wider than the usual 0.02 so that random logits are well separated and greedy choices
        # are not decided by rounding noise.
        initializer_range=0.08,
        dtype=dtype,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(256, size.max_position_embeddings // 8),
        }
        return LlamaConfig(rope_parameters=rope, **common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, rope_parameters=_ROPE_1M, **common)
    if arch == "qwen2":
        return Qwen2Config(rope_parameters=_ROPE_1M, use_sliding_window=False, **common)
    if arch == "qwen3":
        # Qwen3's own default head_dim is 128 whatever the width; the small sizes need theirs.
        head_dim = size.hidden_size // size.num_heads
        return Qwen3Config(
            rope_parameters=_ROPE_1M,
            use_sliding_window=False,
            head_dim=head_dim,
            attention_bias=False,
            **common,
        )
    if arch == "phi3":
        # Phi-4-mini's shape: LongRoPE over three quarters of each head. The pre-training context is
        # the whole context here, so its short factors (random, to be seen) serve every position;
        # tests lower original_max_position_embeddings to reach the long ones.
        rotary = (size.hidden_size // size.num_heads) * 3 // 4
        gen = random.Random(size.hidden_size)
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": size.max_position_embeddings,
            "short_factor": [round(gen.uniform(1.0, 2.0), 3) for _ in range(rotary // 2)],
            "long_factor": [round(gen.uniform(2.0, 8.0), 3) for _ in range(rotary // 2)],
        }
        return Phi3Config(
            rope_parameters=rope,
            original_max_position_embeddings=size.max_position_embeddings,
            sliding_window=None,
            **common,
        )
    if arch == "mixtral":
        return MixtralConfig(
            sliding_window=None,
            rope_parameters=_ROPE_1M,
            num_local_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            **common,
        )
    if arch == "qwen3_moe":
        # head_dim: a config field the class's signature does not name.
        extra: dict[str, Any] = {"head_dim": size.hidden_size // size.num_heads}
        # The first layer keeps a dense MLP (mlp_only_layers), the others are sparse with experts
        # half the dense width, and the chosen experts' weights renormalised, as Qwen3-30B-A3B.
        return Qwen3MoeConfig(
            rope_parameters=_ROPE_1M,
            use_sliding_window=False,
            attention_bias=False,
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            moe_intermediate_size=size.intermediate_size // 2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
            **extra,
            **common,
        )
    if arch in ("gemma2", "gemma3"):
        return _gemma_config(arch, size, common)
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def _gemma_config(arch: str, size: ModelSize, common: dict[str, Any]):
    """Gemma 2 and 3 shapes: a sliding window (half the width in tokens, so that test sequences
    outrun it) on every other layer (Gemma 2) or on five of six (Gemma 3, with at least one full
    layer), a query scalar other than head_dim, tied embeddings. Gemma 2's soft caps are far
    smaller than the released 50 and 30 so that a missing cap changes random-weight logits."""
    from transformers import Gemma2Config, Gemma3TextConfig

    head_dim = size.hidden_size // size.num_heads
    layers = size.num_layers
    shared: dict[str, Any] = dict(
        common,
        tie_word_embeddings=True,
        head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=2 * head_dim,
        sliding_window=size.hidden_size // 2,
    )
    if arch == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return Gemma2Config(
            layer_types=types,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **shared,
        )
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    }
    return Gemma3TextConfig(layer_types=types, rope_parameters=rope, **shared)


def make_model(
    out: str | os.PathLike[str],
    *,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    max_shard_size: str | int | None = None,
) -> Path:
    """Write a complete model directory (config, safetensors, tokenizer, generation config) to ``out``."""
    import torch
    from transformers import (
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        GenerationConfig,
        LlamaForCausalLM,
        MistralForCausalLM,
        MixtralForCausalLM,
        Phi3ForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        Qwen3MoeForCausalLM,
    )

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {tuple(SIZES)}")
    spec = SIZES[size]
    tok = train_tokenizer(spec.vocab_size)
    ids = {k: tok.token_to_id(t) for k, t in (("bos", BOS), ("eos", EOS), ("eot", EOT), ("pad", "<|pad|>"))}
    vocab_size = tok.get_vocab_size()
    config = _hf_config(arch, spec, vocab_size, tie_word_embeddings, dtype, ids)
    cls = {
        "llama": LlamaForCausalLM,
        "mistral": MistralForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "phi3": Phi3ForCausalLM,
        "mixtral": MixtralForCausalLM,
        "qwen3_moe": Qwen3MoeForCausalLM,
        "gemma2": Gemma2ForCausalLM,
        "gemma3": Gemma3ForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype)).eval()
    if arch in ("qwen3", "qwen3_moe"):
        # transformers starts every norm at ones; random ones make a misplaced q or k norm weight
        # change the logits.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.uniform_(0.5, 1.5)
    if arch in ("gemma2", "gemma3"):
        # Gemma's norms start at zero (a weight of one); random offsets make a norm read as Llama's
        # (without the one) or misplaced change the logits.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(out_path, safe_serialization=True, **kwargs)
    GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["eot"]], pad_token_id=ids["pad"]
    ).save_pretrained(out_path)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token="<|pad|>", chat_template=CHAT_TEMPLATE
    )
    hf_tok.save_pretrained(out_path)
    _ensure_chat_template_in_config(out_path)
    return out_path


def _ensure_chat_template_in_config(out_path: Path) -> None:
    # Loaders that only read tokenizer_config.json (older transformers, other engines) find it there too.
    cfg_file = out_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if "chat_template" not in cfg:
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_file.write_text(json.dumps(cfg, indent=2))
