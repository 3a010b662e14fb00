"""Engine configuration: slotted dataclasses that check their invariants on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An engine setting is out of range or inconsistent with another."""


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # Exactly one sizing rule applies: an explicit block count (tests, tiny pools), a byte budget
    # (CPU), or a fraction of free GPU memory measured after a warm-up forward (GPU).
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    # Chunked prefill lets a long prompt be split across steps and mixed with running decodes.
    enable_chunked_prefill: bool = True
    # Only prompts at least this long are chunked when chunking is off.
    long_prefill_token_threshold: int = 0
    # While sequences are decoding, a step computes at most this many prompt tokens (0: no cap
    # beyond max_num_batched_tokens): shorter steps while prompts arrive, so running streams keep
    # their pace between tokens; the same prompt work is spread over more steps.
    max_prefill_tokens_with_decodes: int = 0
    # Order within a priority tier: "fair" (weighted fair share of service across tenants) or
    # "fcfs" (arrival order alone).
    policy: str = "fair"

    def __post_init__(self) -> None:
        if self.max_prefill_tokens_with_decodes < 0:
            raise ConfigError("max_prefill_tokens_with_decodes must be >= 0")
        if self.policy not in ("fair", "fcfs"):
            raise ConfigError(f"policy must be fair or fcfs, got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs and not self.enable_chunked_prefill:
            raise ConfigError("max_num_batched_tokens must be >= max_num_seqs")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(slots=True)
class LoRAConfig:
    max_loras: int = 4  # adapter slots on the device
    max_cpu_loras: int = 16  # host cache of loaded adapters
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ConfigError("need max_loras >= 1 and max_cpu_loras >= max_loras")
        if self.max_lora_rank < 1:
            raise ConfigError("max_lora_rank must be >= 1")


@dataclass(slots=True)
class EngineConfig:
    model: str  # path to a Hugging Face model directory
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype (float32 on CPU when it is float16)
    device: str = "auto"  # auto: cuda when available, else cpu
    attention_backend: str = "auto"  # torch | triton | auto (triton on cuda, torch on cpu)
    seed: int = 0
    enforce_eager: bool = False  # True disables CUDA graphs
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    max_model_len: int | None = None  # None: from the model's config, capped by the scheduler's
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig | None = None  # None: LoRA disabled

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ConfigError(f"dtype must be auto or one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1")
