"""A mixture-of-experts layer's experts on CPU: the engine's grouped path against the dense loop and
against transformers' own expert loop, on the same weights.

The layer is layer 0 of the Mixtral-shaped `bench` model (engine.make_model: hidden 512, 8 experts
of 1,408, 2 per token), loaded by the engine's loader as it serves it (oneDNN-packed expert weights
on CPU) and by transformers. For each batch size the same hidden states and the same routing go
through:

- grouped: the engine (engine.models.moe.SparseMoeBlock.grouped): the (token, expert) pairs sorted
  by expert, each expert one multiply over its contiguous block of tokens;
- dense: every expert over every token, each output kept where the token chose it (the reference);
- transformers: MixtralSparseMoeBlock's experts (a masked gather per expert).

Outputs are checked equal before anything is timed; each time is the median of repeated calls.

    OMP_NUM_THREADS=2 .venv/bin/python bench/moe_experts.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from common import bench_model_dir, log  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()  # warm: oneDNN's first call per shape builds its kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,64,256", help="token counts per call")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--size", default="bench", help="engine.make_model size of the Mixtral model")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models import load_model
    from engine.models.moe import SparseMoeBlock, route

    model_dir = bench_model_dir(arch="mixtral", size=args.size)
    ours = load_model(model_dir, TorchAttentionBackend())
    block = ours.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    packed = block.packed_w13 is not None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_experts = hf.model.layers[0].mlp.experts
    cfg = ours.config
    log(
        f"{model_dir.name}: hidden {cfg.hidden_size}, {cfg.num_experts} experts of {cfg.moe_intermediate_size}, "
        f"{cfg.num_experts_per_tok} per token; packed expert weights: {packed}; threads {torch.get_num_threads()}"
    )
    results = []
    gen = torch.Generator().manual_seed(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(batch, cfg.hidden_size, generator=gen)
        with torch.inference_mode():
            weights, experts = route(block.gate(x), block.top_k, block.renormalize)
            grouped = block.grouped(x, weights, experts)
            dense = block.dense(x, weights, experts)
            reference = hf_experts(x, experts, weights)
            torch.testing.assert_close(grouped, dense, atol=1e-4, rtol=0)
            torch.testing.assert_close(grouped, reference, atol=1e-4, rtol=0)
            row = {
                "batch": batch,
                "grouped_ms": round(median_ms(partial(block.grouped, x, weights, experts), args.repeats), 3),
                "dense_ms": round(median_ms(partial(block.dense, x, weights, experts), args.repeats), 3),
                "transformers_ms": round(
                    median_ms(partial(hf_experts, x, experts, weights), args.repeats), 3
                ),
            }
        row["vs_dense"] = round(row["dense_ms"] / row["grouped_ms"], 2)
        row["vs_transformers"] = round(row["transformers_ms"] / row["grouped_ms"], 2)
        log(
            f"batch {batch:4d}: grouped {row['grouped_ms']:.2f} ms, dense {row['dense_ms']:.2f} ms "
            f"({row['vs_dense']}x), transformers {row['transformers_ms']:.2f} ms ({row['vs_transformers']}x)"
        )
        results.append(row)
    at_64 = next((r for r in results if r["batch"] == 64), results[-1])
    print(
        json.dumps(
            {
                "bench": "moe_experts",
                "model": model_dir.name,
                "threads": torch.get_num_threads(),
                "packed": packed,
                "batches": results,
                "batch64_vs_dense": at_64["vs_dense"],
                "batch64_vs_transformers": at_64["vs_transformers"],
            }
        )
    )


if __name__ == "__main__":
    main()
