"""Engine configuration: slotted dataclasses that check their invariants on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.rules import DEFAULT_BLOCK_SIZE, default_max_seqs_per_request

_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An engine setting is out of range or inconsistent with another."""


@dataclass(slots=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
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
    # While a more important tier has sequences running, a step computes at most this many prompt
    # tokens for sequences of less important tiers (the flex tier's batch lines beside interactive
    # traffic), and none while a more important prompt waits to start or is being computed: the less
    # important tier takes the capacity the other leaves without lengthening its steps much. None:
    # no cap (tiers differ only in order and preemption).
    lower_tier_prefill_tokens: int | None = 64
    # Order within a priority tier: "fair" (weighted fair share of service across tenants) or
    # "fcfs" (arrival order alone).
    policy: str = "fair"
    # Sequences (`n`) one request may run: fewer than max_num_seqs, so that one request never holds
    # every slot. None: engine.rules.default_max_seqs_per_request (a quarter of max_num_seqs).
    max_seqs_per_request: int | None = None
    # Fair share preempts the most-served tenant's running sequences for a waiting tenant that holds
    # fewer slots; the computed tokens those preemptions throw away accrue at this many per step (a
    # token bucket holding at most max_model_len). None: a quarter of max_num_batched_tokens; 0: never.
    fair_preempt_tokens_per_step: int | None = None
    # While two or more tenants are present, a step's decodes and prompt tokens stay within this
    # multiple of the step the least demanding tenant would run alone (engine.step_width); the
    # widest tenants' sequences take turns and their prompts go a chunk a step. 0: no bound.
    shared_step_slowdown: float = 1.5
    # A decode step's fixed cost (reading the weights) in rows of per-sequence cost. None: measured
    # at warm-up on CPU (engine.warm_up.shared_step_costs); on a GPU, or without warm-up, unknown,
    # and then nothing is held back.
    decode_fixed_rows: float | None = None
    # A prompt token's cost in rows of a decoded sequence's (for the same bound). None: measured at
    # warm-up on CPU with decode_fixed_rows; unknown, prompt tokens are not held back.
    prompt_token_rows: float | None = None
    # What a long context and prompt logprobs add (for the same bound), in rows: a decoded
    # sequence's key past the first 100, a key a prompt token attends, a prompt token scored for
    # prompt logprobs. None: measured at warm-up on CPU; unknown, 0.
    decode_key_rows: float | None = None
    prompt_key_rows: float | None = None
    prompt_logprob_rows: float | None = None

    def __post_init__(self) -> None:
        if self.max_prefill_tokens_with_decodes < 0:
            raise ConfigError("max_prefill_tokens_with_decodes must be >= 0")
        if self.lower_tier_prefill_tokens is not None and self.lower_tier_prefill_tokens < 0:
            raise ConfigError("lower_tier_prefill_tokens must be >= 0")
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
        if self.max_seqs_per_request is None:
            self.max_seqs_per_request = default_max_seqs_per_request(self.max_num_seqs)
        elif not 1 <= self.max_seqs_per_request < max(2, self.max_num_seqs):
            raise ConfigError(
                f"max_seqs_per_request must be >= 1 and below max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_seqs_per_request}"
            )
        if self.shared_step_slowdown != 0 and self.shared_step_slowdown < 1:
            raise ConfigError(
                f"shared_step_slowdown must be 0 (off) or >= 1, got {self.shared_step_slowdown}"
            )
        if self.decode_fixed_rows is not None and self.decode_fixed_rows < 0:
            raise ConfigError(f"decode_fixed_rows must be >= 0, got {self.decode_fixed_rows}")
        if self.prompt_token_rows is not None and self.prompt_token_rows <= 0:
            raise ConfigError(f"prompt_token_rows must be > 0, got {self.prompt_token_rows}")
        for name in ("decode_key_rows", "prompt_key_rows", "prompt_logprob_rows"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.fair_preempt_tokens_per_step is None:
            self.fair_preempt_tokens_per_step = self.max_num_batched_tokens // 4
        elif self.fair_preempt_tokens_per_step < 0:
            raise ConfigError(
                f"fair_preempt_tokens_per_step must be >= 0, got {self.fair_preempt_tokens_per_step}"
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
class StructuredOutputConfig:
    """Bounds on what a constrained request may cost the engine (engine_settings grammar_*)."""

    # Seconds a grammar may take to compile (and have its mask cost measured); its request then
    # ends with grammar_compile_timeout and the compile process is killed.
    compile_timeout_s: float = 10.0
    # Compile processes per replica, and how many of them one tenant may hold at once.
    max_compiles: int = 2
    max_compiles_per_tenant: int = 1
    # A compile still running after BACKGROUND_AFTER_S (engine.structured_output.compiler) goes on
    # at this nice value (0: at the engine's own): the engine's steps, which every tenant waits on,
    # come before one request's slow grammar when the cores are busy.
    compile_nice: int = 10
    # CPU milliseconds one token mask of a grammar may take, measured on a short walk after
    # compiling (the costliest mask met); above it the request ends with grammar_too_costly.
    # Ordinary schemas take well under a millisecond; a bounded string (maxLength 40) 1-3 ms on a
    # small CPU; `.{0,500}` and wider about 10 ms.
    max_mask_ms: float = 8.0
    # CPU milliseconds one step's masks for one request may take: that mask cost times the
    # request's n. Above it the request ends with grammar_too_costly.
    max_request_mask_ms: float = 64.0
    # Bytes of compiled grammars kept (xgrammar's memory_size_bytes plus the spec's text).
    cache_bytes: int = 256 * 2**20
    # Threads that fill a step's masks (0: xgrammar's choice, half the cores).
    mask_threads: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.compile_timeout_s < float("inf"):
            raise ConfigError(f"grammar compile_timeout_s must be positive, got {self.compile_timeout_s}")
        if self.max_compiles < 1 or not 1 <= self.max_compiles_per_tenant <= self.max_compiles:
            raise ConfigError("need max_compiles >= 1 and 1 <= max_compiles_per_tenant <= max_compiles")
        if not 0 <= self.compile_nice <= 19:
            raise ConfigError(f"grammar compile_nice must be within 0..19, got {self.compile_nice}")
        if not 0 < self.max_mask_ms < float("inf"):
            raise ConfigError(f"grammar max_mask_ms must be positive, got {self.max_mask_ms}")
        if not 0 < self.max_request_mask_ms < float("inf"):
            raise ConfigError(f"grammar max_request_mask_ms must be positive, got {self.max_request_mask_ms}")
        if self.cache_bytes < 0 or self.mask_threads < 0:
            raise ConfigError("grammar cache_bytes and mask_threads must be >= 0")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine.speculative): drafts copied from the sequence's own prompt and
    output by n-gram lookup, or decoded by a smaller draft model of the same tokenizer
    (engine.draft_model), verified in one forward of the model."""

    # Tokens proposed (and verified) per step at most.
    num_speculative_tokens: int = 4
    # Shortest and longest suffix n-gram looked up in the sequence's earlier tokens.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # A sequence whose drafts are accepted less often than this (over its last
    # `acceptance_window` drafted tokens) stops speculating for a while (engine.speculative).
    min_acceptance: float = 0.3
    acceptance_window: int = 16
    # A model directory whose greedy decoding proposes the drafts instead of n-gram lookup, and
    # the blocks of its own KV cache (engine.draft_model).
    draft_model: str | None = None
    draft_num_blocks: int = 1024

    def __post_init__(self) -> None:
        if self.draft_num_blocks < 1:
            raise ConfigError(f"draft_num_blocks must be >= 1, got {self.draft_num_blocks}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ConfigError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ConfigError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")
        if self.acceptance_window < 1:
            raise ConfigError(f"acceptance_window must be >= 1, got {self.acceptance_window}")


@dataclass(slots=True)
class EngineConfig:
    model: str  # path to a Hugging Face model directory
    # generate | embed | auto (embed for an encoder, generate for a decoder): the engine that serves
    # it (engine.llm_engine or engine.embedding_engine).
    task: str = "auto"
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype (float32 on CPU when it is float16)
    device: str = "auto"  # auto: cuda when available, else cpu
    attention_backend: str = "auto"  # torch | triton | auto (triton on cuda, torch on cpu)
    seed: int = 0
    enforce_eager: bool = False  # True disables CUDA graphs
    # On a GPU, one forward of each eager step shape before serving (engine.warm_up); False leaves
    # the kernels' compiles to the first requests.
    warm_up: bool = True
    # Decode batch sizes captured as CUDA graphs (a batch is padded up to the next one); empty: 1,
    # 2, 4 and every multiple of 8, up to the scheduler's max_num_seqs (see `graph_batch_sizes`).
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    max_model_len: int | None = None  # None: from the model's config, capped by the scheduler's
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig | None = None  # None: LoRA disabled
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.task not in ("auto", "generate", "embed"):
            raise ConfigError(f"task must be auto, generate or embed, got {self.task!r}")
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
