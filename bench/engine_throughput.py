"""Output tokens/s: the engine against transformers' generate with static padded batches, on CPU.

One seeded workload (prompt lengths uniform in 32-512, output lengths uniform in 16-256, EOS ignored)
through both. transformers runs batches of 16 in arrival order, left-padded, each batch decoding until
its longest request is done; only the requested tokens count as output. The engine gets every request
at once and schedules them continuously. Prints a final JSON line.

    .venv/bin/python bench/engine_throughput.py                  # the full 128-request workload
    .venv/bin/python bench/engine_throughput.py --num-requests 16   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def bench_model_dir(arch: str = "llama", dtype: str = "float32") -> Path:
    """The ~30M-parameter benchmark model, built once and cached."""
    from engine.make_model import make_model

    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda")) / "models"
    out = root / f"{arch}-bench-{dtype}-seed0"
    if not (out / "config.json").exists():
        make_model(out, arch=arch, size="bench", seed=0, dtype=dtype)
    return out


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(6, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(n)
    ]


def run_transformers(model_dir: Path, reqs: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def run_engine(model_dir: Path, reqs: list[tuple[list[int], int]], args: argparse.Namespace) -> tuple[float, int]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_mib * 1024**2,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' static batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or bench_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = workload(args.num_requests, args.seed, vocab)
    wanted = sum(n for _, n in reqs)

    engine_s, produced = run_engine(model_dir, reqs, args)
    assert produced == wanted, (produced, wanted)
    result = {
        "bench": "engine_throughput",
        "model": model_dir.name,
        "num_requests": len(reqs),
        "output_tokens": wanted,
        "threads": args.threads,
        "engine_s": round(engine_s, 2),
        "engine_tok_s": round(wanted / engine_s, 1),
    }
    print(f"engine: {wanted} tokens in {engine_s:.1f}s", file=sys.stderr)
    if not args.skip_transformers:
        hf_s = run_transformers(model_dir, reqs, args.batch_size, pad_id=5)
        result.update(
            transformers_s=round(hf_s, 2),
            transformers_tok_s=round(wanted / hf_s, 1),
            ratio=round(hf_s / engine_s, 2),
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
