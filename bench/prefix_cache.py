"""Time to first token with a shared prefix, prefix cache cold vs warm, and the KV cache's waste.

Requests share a long common prefix (a system prompt of --prefix-len tokens, 1,024 by default) and
differ in a short suffix. Each is sent alone and timed from add_request to the step that returns
its first token, so a TTFT is the prefill latency of one request:

- cold: an engine with prefix caching disabled computes every prompt in full;
- warm: an engine with prefix caching, after one request has put the prefix in the cache,
  computes only each suffix (and checks that every warm request reports the prefix as cached).

KV-cache waste is measured on a mixed continuous-batching run (requests with and without the
shared prefix, varied prompt and output lengths): after every step, the slots of the blocks held by
running sequences (each shared block once) against the slots holding a computed token.
waste = 1 - used / allocated, summed over steps. Prints a final JSON line.

    OMP_NUM_THREADS=2 .venv/bin/python bench/prefix_cache.py
    OMP_NUM_THREADS=2 .venv/bin/python bench/prefix_cache.py --num-requests 4 --mixed-requests 8
    OMP_NUM_THREADS=2 .venv/bin/python bench/prefix_cache.py --real-model   # SmolLM2-135M-Instruct, real text
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import PromptSource, bench_model_dir, log, num_parameters, percentile, real_model_dir  # noqa: E402


def make_engine(model_dir: Path, args: argparse.Namespace, *, prefix_caching: bool):
    from engine.llm import engine_config_from_kwargs
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        engine_config_from_kwargs(
            str(model_dir),
            dtype="float32",
            device="cpu",
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=args.kv_cache_mib * 1024**2,
            enable_prefix_caching=prefix_caching,
        )
    )


def time_to_first_token(engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the step that yields the first token; the prompt tokens the
    engine found cached."""
    from engine.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids_delta:
                ttft = time.perf_counter() - start
                while engine.has_unfinished_requests():  # max_tokens=1: already finished
                    engine.step()
                return ttft, out.num_cached_tokens


def kv_slots(engine) -> tuple[int, int]:
    """(allocated, used) KV slots of the running sequences: a block shared by several sequences
    (a cached prefix) counts once; a slot is used when a computed token's K/V sits in it."""
    scheduler = engine.scheduler
    block_size = scheduler.block_size
    used_by_block: dict[int, int] = {}
    for seq in scheduler.running:
        for i, block_id in enumerate(seq.block_table):
            used = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
            used_by_block[block_id] = max(used, used_by_block.get(block_id, 0))
    return len(used_by_block) * block_size, sum(used_by_block.values())


def mixed_run(
    engine, prefix: list[int], args: argparse.Namespace, rng: random.Random, source: PromptSource
) -> dict:
    from engine.sampling_params import SamplingParams

    for i in range(args.mixed_requests):
        suffix = source.take(rng.randint(16, 64))
        own = source.take(rng.randint(32, 512))
        prompt = prefix + suffix if i % 2 == 0 else own
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 128), ignore_eos=True)
        engine.add_request(f"mixed-{i}", prompt, params)
    allocated = used = steps = 0
    worst = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        a, u = kv_slots(engine)
        if a:
            allocated, used, steps = allocated + a, used + u, steps + 1
            worst = max(worst, 1 - u / a)
    return {
        "kv_waste": round(1 - used / allocated, 4),
        "kv_waste_worst_step": round(worst, 4),
        "kv_waste_steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=16, help="timed requests, cold and warm each")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--mixed-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--size", default="bench", help="engine.make_model size of the built model")
    parser.add_argument("--model-dir", type=Path, default=None, help="an existing model directory instead")
    parser.add_argument(
        "--real-model",
        action="store_true",
        help="SmolLM2-135M-Instruct on prompts of real text (fetched once)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = real_model_dir() if args.real_model else (args.model_dir or bench_model_dir(size=args.size))
    rng = random.Random(args.seed)
    source = PromptSource(model_dir, rng, real_text=args.real_model)
    prefix = source.take(args.prefix_len)
    prompts = [prefix + source.take(rng.randint(16, 64)) for _ in range(args.num_requests)]

    cold_engine = make_engine(model_dir, args, prefix_caching=False)
    time_to_first_token(cold_engine, "cold-warmup", prompts[0])  # first-call costs, not the cache
    cold = [time_to_first_token(cold_engine, f"cold-{i}", p)[0] for i, p in enumerate(prompts)]
    log(f"cold: p50 {percentile(cold, 50) * 1e3:.0f} ms")
    del cold_engine

    warm_engine = make_engine(model_dir, args, prefix_caching=True)
    time_to_first_token(warm_engine, "warm-prime", prefix + source.take(1))
    warm: list[float] = []
    for i, p in enumerate(prompts):
        ttft, cached = time_to_first_token(warm_engine, f"warm-{i}", p)
        expected = args.prefix_len // warm_engine.scheduler.block_size * warm_engine.scheduler.block_size
        assert cached >= expected, f"warm request {i} found {cached} cached tokens, expected {expected}"
        warm.append(ttft)
    log(f"warm: p50 {percentile(warm, 50) * 1e3:.0f} ms")
    hit_rate = warm_engine.get_stats()["prefix_cache_hit_rate"]
    del warm_engine

    waste = mixed_run(make_engine(model_dir, args, prefix_caching=True), prefix, args, rng, source)
    result = {
        "bench": "prefix_cache",
        "model": model_dir.name,
        "prompts": "real text" if args.real_model else "random token ids",
        "params_m": round(num_parameters(model_dir) / 1e6, 1),
        "dtype": "float32",
        "device": "cpu",
        "threads": args.threads,
        "prefix_tokens": args.prefix_len,
        "num_requests": len(prompts),
        "cold_ttft_p50_ms": round(percentile(cold, 50) * 1e3, 1),
        "cold_ttft_p99_ms": round(percentile(cold, 99) * 1e3, 1),
        "warm_ttft_p50_ms": round(percentile(warm, 50) * 1e3, 1),
        "warm_ttft_p99_ms": round(percentile(warm, 99) * 1e3, 1),
        "ttft_p50_speedup": round(percentile(cold, 50) / percentile(warm, 50), 2),
        "ttft_p99_speedup": round(percentile(cold, 99) / percentile(warm, 99), 2),
        "warm_prefix_hit_rate": round(float(hit_rate), 4),
        "mixed_requests": args.mixed_requests,
        **waste,
    }
    print(
        f"TTFT cold p50 {result['cold_ttft_p50_ms']} ms p99 {result['cold_ttft_p99_ms']} ms; "
        f"warm p50 {result['warm_ttft_p50_ms']} ms p99 {result['warm_ttft_p99_ms']} ms; "
        f"speedup p50 {result['ttft_p50_speedup']}x p99 {result['ttft_p99_speedup']}x",
        flush=True,
    )
    print(f"KV-cache waste over the mixed run: {waste['kv_waste']:.2%}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
