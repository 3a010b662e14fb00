"""Output tokens/s of one workload spread over 4 LoRA adapters against the same workload on the base model.

One seeded workload (prompt lengths uniform in 32-256, output lengths uniform in 32-128, EOS ignored)
runs on two engines in one process: one without LoRA, and one with LoRA enabled where request i
uses adapter i % 4 (rank 16 on q, k, v, o, gate, up, down; random PEFT weights), so every step
mixes all four adapters. The engines are stepped in turn and each one's busy time counts, so a
shared machine's load falls on both alike; the best of --rounds rounds is reported. Prints a
final JSON line.

    .venv/bin/python bench/multi_lora.py                    # 64 requests, small model, CPU, 1 thread
    .venv/bin/python bench/multi_lora.py --num-requests 16  # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_dir(size: str) -> Path:
    from engine.make_model import make_model

    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda")) / "models"
    out = root / f"llama-{size}-float32-seed0"
    if not (out / "config.json").exists():
        make_model(out, arch="llama", size=size, seed=0, dtype="float32")
    return out


def make_adapters(base_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """PEFT directories as a fine-tuning run writes them, with seeded random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
            LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0),
        )
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        model.save_pretrained(out / f"adapter-{i}")
        paths.append(out / f"adapter-{i}")
    return paths


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(6, vocab) for _ in range(rng.randint(32, 256))], rng.randint(32, 128))
        for _ in range(n)
    ]


def make_engine(base_dir: Path, args: argparse.Namespace, *, lora: bool):
    from engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(base_dir),
            dtype="float32",
            device="cpu",
            cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_mib * 1024**2),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
            ),
            lora=LoRAConfig(max_loras=args.num_adapters, max_lora_rank=args.rank) if lora else None,
        )
    )


def add_workload(engine, reqs: list[tuple[list[int], int]], adapters: list[Path], tag: str) -> None:
    from engine.protocol import LoRARef
    from engine.sampling_params import SamplingParams

    for i, (prompt, n) in enumerate(reqs):
        lora = (
            LoRARef(f"adapter-{i % len(adapters)}", str(adapters[i % len(adapters)]), "1")
            if adapters
            else None
        )
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params, tenant="bench", lora=lora)


def run_interleaved(
    engines: list, reqs: list[tuple[list[int], int]], adapters: list[list[Path]], tag: str
) -> list[tuple[float, int]]:
    """Each engine's busy seconds and output tokens for the workload, stepping the engines in turn.

    Alternating single steps exposes both engines to the same moments of a shared machine's load,
    which separate back-to-back runs do not.
    """
    busy = [0.0] * len(engines)
    produced = [0] * len(engines)
    for i, engine in enumerate(engines):
        start = time.perf_counter()
        add_workload(engine, reqs, adapters[i], f"{tag}-{i}")
        busy[i] += time.perf_counter() - start
    while any(engine.has_unfinished_requests() for engine in engines):
        for i, engine in enumerate(engines):
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outputs = engine.step()
            busy[i] += time.perf_counter() - start
            produced[i] += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
    return list(zip(busy, produced, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--size", default="small", help="engine.make_model size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    # One thread by default: on a shared CPU, OpenMP threads stall at barriers whenever a sibling is
    # descheduled, and each small op pays for it, which would measure the machine's load, not LoRA.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base_dir = model_dir(args.size)
    vocab = json.loads((base_dir / "config.json").read_text())["vocab_size"]
    reqs = workload(args.num_requests, args.seed, vocab)
    wanted = sum(n for _, n in reqs)

    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(base_dir, Path(tmp), args.num_adapters, args.rank)
        base_engine, lora_engine = (
            make_engine(base_dir, args, lora=False),
            make_engine(base_dir, args, lora=True),
        )
        # Warm-up: first-call allocations and, for LoRA, reading every adapter from disk.
        run_interleaved([base_engine, lora_engine], reqs[: len(adapters)], [[], adapters], "warm")
        base_s, lora_s = float("inf"), float("inf")
        for r in range(args.rounds):
            (b_s, b_n), (l_s, l_n) = run_interleaved(
                [base_engine, lora_engine], reqs, [[], adapters], f"r{r}"
            )
            assert b_n == l_n == wanted, (b_n, l_n, wanted)
            base_s, lora_s = min(base_s, b_s), min(lora_s, l_s)
            print(f"round {r}: base {wanted / b_s:.1f} tok/s, lora {wanted / l_s:.1f} tok/s", file=sys.stderr)
        stats = lora_engine.get_stats()

    result = {
        "bench": "multi_lora",
        "model": base_dir.name,
        "device": "cpu",
        "threads": args.threads,
        "num_requests": len(reqs),
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "output_tokens": wanted,
        "base_s": round(base_s, 2),
        "lora_s": round(lora_s, 2),
        "base_tok_s": round(wanted / base_s, 1),
        "lora_tok_s": round(wanted / lora_s, 1),
        "ratio": round(base_s / lora_s, 3),
        "lora_slot_loads": stats["num_lora_slot_loads"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
