"""This machine's ceilings, and where the engine's forward steps stand against them.

Ceilings, measured here, on the device the engine runs on:

- memory bandwidth: a STREAM-like triad (a = b + s * c) over float32 arrays far larger than the
  caches; bytes = two reads and one write per element; the best of several passes;
- GEMM throughput in float32 and bfloat16 through ``torch.nn.functional.linear``, the call the
  engine's linear layers make for prefill and wide batches (oneDNN/MKL on CPU, cuBLAS on a GPU;
  float32 on a GPU without TF32, as the engine runs it); the best of several products of two square
  sizes.

Then the engine's forward (``ModelRunner.execute``: the model and the sampled rows' logits, CUDA
graphs where the engine captures them) on SmolLM2-135M-Instruct, timed on synthetic steps built the
way the scheduler builds them (the median of --repeats):

- decode, B sequences each with --context tokens in the cache: bytes moved = every weight once plus
  each sequence's K and V; the memory roof is bytes / bandwidth;
- prefill, one prompt of T tokens (or several, on a GPU): FLOPs = 2 x tokens x the non-embedding
  weights, plus causal attention (2 x heads x head_dim x T^2 per layer); the compute roof is FLOPs /
  GEMM peak of the dtype.

Each step's roof is the larger of its memory and compute times; "of roof" is roof / measured, so
100 % would be a step running at the machine's limit. Prints a table and a final JSON line.

    OMP_NUM_THREADS=2 .venv/bin/python bench/roofline.py                    # CPU, float32 and bfloat16
    python bench/roofline.py --device cuda --dtypes bfloat16 float32        # on a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import log, real_model_dir  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocations, kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(device: torch.device, mib: int, repeats: int) -> float:
    """Bytes per second of the triad a = b + 3 * c (each array `mib` MiB)."""
    n = mib * 2**20 // 4
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    seconds = _best_time(lambda: torch.add(b, c, alpha=3.0, out=a), device, repeats)
    return 3 * n * 4 / seconds


def gemm_flops(device: torch.device, dtype: torch.dtype, sizes: list[int], repeats: int) -> float:
    """The best FLOP/s of F.linear on (size x size) by a (size x size) weight, over `sizes`."""
    best = 0.0
    for size in sizes:
        x = torch.randn(size, size, device=device, dtype=dtype)
        w = torch.randn(size, size, device=device, dtype=dtype)
        with torch.inference_mode():
            seconds = _best_time(lambda: torch.nn.functional.linear(x, w), device, repeats)  # noqa: B023
        best = max(best, 2 * size**3 / seconds)
    return best


class Steps:
    """Synthetic forward steps on one engine's runner (engine.warm_up.synthetic_step): the
    sequences hold zeros, which costs the same as text."""

    def __init__(self, llm, device: torch.device) -> None:
        self.runner = llm.engine.runner
        self.device = device
        self.model = self.runner.model
        self.cfg = self.model.config
        embed = self.model.model.embed_tokens.weight
        self.elem = embed.element_size()
        # The decoder layers' weights, and the logits' head (tied to the embedding or not): the
        # embedding lookup reads only a few rows.
        self.head_params = embed.numel()
        self.layer_params = sum(p.numel() for p in self.model.model.layers.parameters())
        self.weight_bytes = (self.layer_params + self.head_params) * self.elem

    def time(self, lengths: list[int], new_tokens: list[int], repeats: int) -> float:
        from engine.warm_up import synthetic_step

        inputs = self.runner.prepare(synthetic_step(self.runner, lengths, new_tokens))
        times = []
        for i in range(repeats + 2):
            _sync(self.device)
            start = time.perf_counter()
            self.runner.execute(inputs)
            _sync(self.device)
            if i >= 2:  # the first two: Triton compiles, allocator growth
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def kv_bytes(self, tokens: int) -> int:
        from engine.model_runner import kv_cache_bytes_per_block

        return tokens * kv_cache_bytes_per_block(self.model, block_size=1)

    def decode_flops(self, batch: int) -> float:
        return 2 * batch * (self.layer_params + self.head_params)

    def prefill_flops(self, prompts: list[int]) -> float:
        """The layers for every token, causal attention, and the logits of each prompt's last token."""
        c = self.cfg
        attention = sum(2 * c.num_heads * c.head_dim * t * t * c.num_layers for t in prompts)
        return 2 * sum(prompts) * self.layer_params + attention + 2 * len(prompts) * self.head_params


def _row(dtype: str, step: str, seconds: float, memory_s: float, compute_s: float) -> dict:
    roof = max(memory_s, compute_s)
    return {
        "dtype": dtype,
        "step": step,
        "ms": round(seconds * 1e3, 3),
        "roof_ms": round(roof * 1e3, 3),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "of_roof_pct": round(100 * roof / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=512, help="tokens each decoding sequence holds")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes")
    parser.add_argument("--prompts", type=int, nargs="+", default=None, help="prefill prompt lengths")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    batches = args.batches or ([1, 8, 32, 128, 256] if gpu else [1, 8, 32])
    prompts = args.prompts or ([512, 2048, 8192] if gpu else [512, 2048])

    bandwidth = memory_bandwidth(device, 1024 if gpu else 256, args.repeats)
    machine = (
        torch.cuda.get_device_name(device)
        if gpu
        else f"{platform.processor() or 'cpu'}, {args.threads} threads"
    )
    result: dict = {"bench": "roofline", "device": machine, "bandwidth_gb_s": round(bandwidth / 1e9, 1)}
    log(f"{machine}: triad bandwidth {bandwidth / 1e9:.1f} GB/s")

    from engine.llm import LLM
    from engine.models import load_model_config

    model_dir = real_model_dir()
    cfg = load_model_config(model_dir)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        peak = gemm_flops(device, dtype, [4096, 8192] if gpu else [1024, 2048], args.repeats)
        result[f"gemm_{dtype_name}_tflop_s"] = round(peak / 1e12, 3)
        log(f"{dtype_name}: GEMM {peak / 1e12:.3f} TFLOP/s")
        elem = torch.tensor([], dtype=dtype).element_size()
        max_seqs = max(batches)
        kv_tokens = max(max_seqs * (args.context + 1), sum(prompts)) + 64 * max_seqs
        per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem  # K and V, every layer
        llm = LLM(
            str(model_dir),
            device=args.device,
            dtype=dtype_name,
            max_num_seqs=max_seqs,
            max_model_len=max(max(prompts), args.context + 1),
            max_num_batched_tokens=max(max(prompts), 2048),
            kv_cache_memory_bytes=kv_tokens * per_token,
        )
        steps = Steps(llm, device)
        for b in batches:
            seconds = steps.time([args.context + 1] * b, [1] * b, args.repeats)
            moved = steps.weight_bytes + steps.kv_bytes(b * (args.context + 1))
            memory, compute = moved / bandwidth, steps.decode_flops(b) / peak
            rows.append(_row(dtype_name, f"decode b={b} ctx={args.context}", seconds, memory, compute))
        for t in prompts:
            lengths = [min(t, 2048)] * max(1, t // 2048) if t > 2048 else [t]
            seconds = steps.time(lengths, lengths, max(3, args.repeats // 2))
            memory = (steps.weight_bytes + steps.kv_bytes(sum(lengths))) / bandwidth
            compute = steps.prefill_flops(lengths) / peak
            label = f"prefill {len(lengths)}x{lengths[0]}" if len(lengths) > 1 else f"prefill {t}"
            rows.append(_row(dtype_name, label, seconds, memory, compute))
        del llm, steps
        if gpu:
            torch.cuda.empty_cache()
    print(f"{'dtype':9} {'step':24} {'ms':>9} {'roof ms':>9} {'bound':8} {'of roof':>8}")
    for r in rows:
        print(
            f"{r['dtype']:9} {r['step']:24} {r['ms']:9.3f} {r['roof_ms']:9.3f} {r['bound']:8} {r['of_roof_pct']:7.1f}%"
        )
    result["steps"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
