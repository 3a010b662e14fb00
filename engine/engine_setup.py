"""Engine start-up: device, model, tokenizer, context length and KV-cache size, checked before serving."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionBackend
from engine.config import ConfigError, EngineConfig, SchedulerConfig
from engine.model_runner import ModelRunner, kv_cache_bytes_per_block
from engine.models import ModelConfig, ModelLoadError, load_model, load_model_config
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2


@dataclass(slots=True)
class EngineSetup:
    model_config: ModelConfig
    tokenizer: Any
    device: torch.device
    max_model_len: int
    scheduler_config: SchedulerConfig
    num_blocks: int
    model: LlamaForCausalLM
    sampler: Sampler
    cuda_graph_batch_sizes: tuple[int, ...]  # `graph_batch_sizes`: within the scheduler's max_num_seqs
    num_window_blocks: int = 0  # the windowed layers' pool (ModelConfig.kv_window), or 0: none


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def load_tokenizer(model_dir: str | Path) -> Any:
    root = Path(model_dir)
    if not any((root / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        raise ModelLoadError(
            f"{root}: no tokenizer (tokenizer.json or tokenizer.model) in the model directory"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError or its own types
        raise ModelLoadError(f"{root}: the tokenizer could not be loaded ({exc})") from exc


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_model_len
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit}")
        return config.max_model_len
    return min(limit, config.scheduler.max_model_len)


def _profile_gpu_kv_bytes(config: EngineConfig, model, max_model_len: int, sampler: Sampler) -> int:
    """Bytes of KV cache that fit in gpu_memory_utilization of the device after a worst-case
    prefill forward."""
    from engine.scheduler_output import ScheduledSequence, SchedulerOutput
    from engine.sequence import Sequence

    block_size = config.cache.block_size
    n = min(config.scheduler.max_num_batched_tokens, max_model_len)
    probe = ModelRunner(
        model,
        num_blocks=-(-n // block_size),
        num_window_blocks=-(-n // block_size) if model.config.kv_window is not None else 0,
        block_size=block_size,
        max_model_len=max_model_len,
        sampler=sampler,
    )
    from engine.sampling_params import SamplingParams

    seq = Sequence("profile", [0] * n, SamplingParams(max_tokens=1))
    seq.block_table = list(range(-(-n // block_size)))
    seq.window_block_table = list(seq.block_table)
    torch.cuda.reset_peak_memory_stats()
    probe.run(SchedulerOutput([ScheduledSequence(seq, n)], n, [], []))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    probe_cache = sum(k.numel() * k.element_size() * 2 for k, _ in probe.kv_caches)
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # Memory held outside this process's allocator (other processes, the CUDA context) stays used.
    used_elsewhere = total - free - torch.cuda.memory_reserved()
    return int(total * config.cache.gpu_memory_utilization - used_elsewhere - (peak - probe_cache))


def window_pool_need(model_config: ModelConfig, sched: SchedulerConfig, block_size: int) -> int:
    """Window-pool blocks enough for every running sequence at once: each holds at most the blocks
    its window spans, plus a partly filled one at each end, and a step's new tokens need at most
    the step budget's blocks beyond that."""
    window = model_config.kv_window
    assert window is not None
    per_seq = -(-(window - 1) // block_size) + 2
    return sched.max_num_seqs * per_seq + -(-sched.max_num_batched_tokens // block_size)


def resolve_num_blocks(
    config: EngineConfig, model, device: torch.device, max_model_len: int, sampler: Sampler
) -> tuple[int, int]:
    """(blocks of the main pool, blocks of the windowed layers' pool, 0 without one). The window
    pool is sized for the most every running sequence can hold (`window_pool_need`), the main pool
    takes the rest of the budget: with 5 windowed layers of 6 (Gemma 3) nearly six times the blocks
    a single pool would have. An explicit num_blocks sizes both pools (the window pool no larger
    than it needs)."""
    cache, sched = config.cache, config.scheduler
    mc = model.config
    need = window_pool_need(mc, sched, cache.block_size) if mc.kv_window is not None else 0
    if cache.num_blocks is not None:
        return cache.num_blocks, min(cache.num_blocks, need)
    per_block = kv_cache_bytes_per_block(model, cache.block_size)
    if cache.kv_cache_memory_bytes is not None or device.type != "cuda":
        budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    else:
        budget = _profile_gpu_kv_bytes(config, model, max_model_len, sampler)
    num_blocks = budget // per_block
    num_window_blocks = 0
    windowed = sum(1 for w in mc.layer_windows if w is not None)
    if need and windowed == mc.num_layers:
        # Every layer windowed: the main table only names positions (hashes, slots), no K/V.
        num_window_blocks = num_blocks
        num_blocks = 2 * sched.max_num_seqs * -(-max_model_len // cache.block_size)
    elif need and num_blocks > need:
        window_bytes = per_block * windowed // mc.num_layers
        num_window_blocks = need
        num_blocks = (budget - need * window_bytes) // (per_block - window_bytes)
    elif need:
        num_window_blocks = num_blocks  # too small a budget to save anything: one size for both
    if cache.kv_cache_memory_bytes is not None or device.type != "cuda":
        # More blocks than every sequence at full length could fill only hold old prefixes; on
        # CPU that memory is better left to the rest of the machine.
        num_blocks = min(num_blocks, 2 * sched.max_num_seqs * -(-max_model_len // cache.block_size))
        num_window_blocks = min(num_window_blocks, num_blocks)
    if num_blocks < 1:
        raise ConfigError("the KV cache budget does not fit a single block; raise the memory budget")
    return num_blocks, num_window_blocks


def graph_batch_sizes(configured: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes to capture: the configured ones within max_num_seqs, or by default 1,
    2, 4 and every multiple of 8 up to it (a batch is padded to the next size, so the default wastes
    at most 7 rows), and max_num_seqs itself, so that no decode batch runs without a graph."""
    if configured:
        return tuple(sorted({b for b in configured if b <= max_num_seqs}))
    sizes = {b for b in (1, 2, 4) if b <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8))
    return tuple(sorted(sizes | {max_num_seqs}))


def graph_capturable(model_config: ModelConfig) -> bool:
    """Whether a model's decode step can be captured as a CUDA graph. Not Gemma's windowed or
    soft-capped attention, which loops over the host's sequence lengths, nor a mixture of experts,
    grouped by counts read back to the host: a captured graph would freeze both
    (engine.attention.windowed, engine.models.moe)."""
    return not (
        model_config.attn_logit_softcap is not None
        or any(w is not None for w in model_config.layer_windows)
        or model_config.moe_layers
    )


def build_engine_setup(config: EngineConfig) -> EngineSetup:
    model_config = load_model_config(config.model)  # refuses bad directories before any heavy work
    tokenizer = load_tokenizer(config.model)
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    max_model_len = resolve_max_model_len(config, model_config)
    scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
    backend = make_backend(config.attention_backend, device)
    model = load_model(config.model, backend, dtype=config.dtype, device=device, max_model_len=max_model_len)
    sampler = Sampler(model_config.eos_token_ids)
    num_blocks, num_window_blocks = resolve_num_blocks(config, model, device, max_model_len, sampler)
    graph_sizes = graph_batch_sizes(config.cuda_graph_batch_sizes, scheduler_config.max_num_seqs)
    if not graph_capturable(model_config):
        graph_sizes = ()
    return EngineSetup(
        model_config,
        tokenizer,
        device,
        max_model_len,
        scheduler_config,
        num_blocks,
        model,
        sampler,
        graph_sizes,
        num_window_blocks,
    )
