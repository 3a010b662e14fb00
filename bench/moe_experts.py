"""A mixture-of-experts layer's experts: the engine's grouped path against the dense loop and
against transformers' own expert loop, on the same weights, on CPU or a GPU.

By default the layer is layer 0 of the Mixtral-shaped `bench` model (engine.make_model: hidden
512, 8 experts of 1,408, 2 per token), loaded by the engine's loader as it serves it
(oneDNN-packed expert weights on CPU) and by transformers. `--shape mixtral-8x7b` builds one layer
of Mixtral-8x7B's shape instead (hidden 4,096, 8 experts of 14,336, 2 per token; random weights,
about 2.8 GB in bfloat16: for a GPU). For each batch size the same hidden states and the same
routing go through:

- grouped: the engine (engine.models.moe.SparseMoeBlock.grouped): the (token, expert) pairs sorted
  by expert; on CPU each expert is one multiply over its contiguous block of tokens; on a GPU the
  faster of the next two for the experts' size;
- kernel (on a GPU): one Triton grouped GEMM per projection covers every expert
  (kernels.moe_grouped_gemm);
- loop (on a GPU): the same sorted blocks, one cuBLAS multiply per expert and projection;
- dense: every expert over every token, each output kept where the token chose it (the reference);
- transformers: MixtralSparseMoeBlock's experts (a masked gather per expert), for the `bench`
  model.

Outputs are checked equal (to the dtype's rounding) before anything is timed; each time is the
median of repeated calls, the GPU synchronised around each.

    OMP_NUM_THREADS=2 .venv/bin/python bench/moe_experts.py
    python bench/moe_experts.py --device cuda --dtype bfloat16 --shape mixtral-8x7b --batches 1,8,64,256,1024
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


def median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm: oneDNN's first call per shape builds its kernels, Triton compiles
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mixtral_8x7b_block(device: torch.device, dtype: torch.dtype):
    """One SparseMoeBlock of Mixtral-8x7B's shape with random weights (std 0.02, the models'
    initialiser), built directly on the device: no checkpoint of that size is at hand."""
    from types import SimpleNamespace

    from engine.models.moe import SparseMoeBlock

    cfg = SimpleNamespace(
        hidden_size=4096,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        norm_topk_prob=True,
    )
    with torch.device(device):
        block = SparseMoeBlock(cfg).to(dtype)  # type: ignore[arg-type]
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    return block.eval(), cfg


SWEEP = [  # (block_m, block_n, block_k, num_warps, num_stages); block_m None: from the counts
    (None, 64, 64, 4, 3),
    (None, 128, 64, 4, 3),
    (None, 128, 64, 8, 4),
    (16, 128, 128, 4, 4),
    (32, 128, 64, 4, 4),
    (64, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
]


def sweep(block, cfg, batches: list[int], repeats: int, device: torch.device, dtype: torch.dtype) -> None:
    """The gate|up projection's grouped GEMM under each tile setting, beside one cuBLAS multiply
    per expert, on the rows a batch's routing gives; one JSON line per batch."""
    import torch.nn.functional as F

    from engine.models.moe import route
    from kernels.moe_grouped_gemm import moe_grouped_gemm

    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        x = torch.randn(batch, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
        with torch.inference_mode():
            _, experts = route(block.gate(x), block.top_k, block.renormalize)
            flat = experts.reshape(-1)
            order = flat.argsort(stable=True)
            counts = torch.bincount(flat, minlength=cfg.num_experts).tolist()
            rows = x.index_select(0, order // block.top_k)

            def loop(rows=rows, counts=counts):
                start = 0
                for e, c in enumerate(counts):
                    if c:
                        F.linear(rows[start : start + c], block.w13[e])
                    start += c

            timings = {"loop": round(median_ms(loop, repeats, device), 3)}
            reference = moe_grouped_gemm(rows, block.w13, counts)
            for bm, bn, bk, warps, stages in SWEEP:
                name = f"m{bm or 'auto'}-n{bn}-k{bk}-w{warps}-s{stages}"
                run = partial(
                    moe_grouped_gemm,
                    rows,
                    block.w13,
                    counts,
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    num_warps=warps,
                    num_stages=stages,
                )
                try:
                    torch.testing.assert_close(run(), reference, atol=0.05, rtol=0.02)
                    timings[name] = round(median_ms(run, repeats, device), 3)
                except Exception as exc:  # a setting the GPU cannot fit (shared memory)
                    timings[name] = f"{type(exc).__name__}"
        best = min((v, k) for k, v in timings.items() if isinstance(v, float) and k != "loop")
        log(
            f"batch {batch}: rows per expert {counts}; loop {timings['loop']} ms, best {best[1]} {best[0]} ms"
        )
        print(json.dumps({"bench": "moe_grouped_gemm_sweep", "batch": batch, "counts": counts, **timings}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,64,256", help="token counts per call")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--size", default="bench", help="engine.make_model size of the Mixtral model")
    parser.add_argument("--shape", choices=["model", "mixtral-8x7b"], default="model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="(GPU) time the grouped GEMM's tile settings on the gate|up projection",
    )
    args = parser.parse_args()

    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models import load_model
    from engine.models.moe import SparseMoeBlock, route

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hf_experts = None
    if args.shape == "mixtral-8x7b":
        block, cfg = mixtral_8x7b_block(device, dtype)
        name = "mixtral-8x7b-layer-random"
    else:
        from transformers import AutoModelForCausalLM

        model_dir = bench_model_dir(arch="mixtral", size=args.size)
        name = model_dir.name
        ours = load_model(model_dir, TorchAttentionBackend(), dtype=args.dtype, device=device)
        block = ours.model.layers[0].mlp
        assert isinstance(block, SparseMoeBlock)
        cfg = ours.config
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        hf_experts = hf.model.layers[0].mlp.experts
    packed = block.packed_w13 is not None
    on_gpu = device.type == "cuda"
    log(
        f"{name} on {torch.cuda.get_device_name(device) if on_gpu else 'cpu'} in {args.dtype}: hidden "
        f"{cfg.hidden_size}, {cfg.num_experts} experts of {cfg.moe_intermediate_size}, {cfg.num_experts_per_tok} "
        f"per token; packed expert weights: {packed}; threads {torch.get_num_threads()}"
    )

    def forced(kernel: bool, x, weights, experts):
        block.use_kernel = kernel
        try:
            return block.grouped(x, weights, experts)
        finally:
            block.use_kernel = None

    if args.sweep:
        sweep(block, cfg, [int(b) for b in args.batches.split(",")], args.repeats, device, dtype)
        return
    # float32: summation order only; bfloat16: intermediates rounded in another order, a few units
    # of its last place on outputs of about 2 (a wrong layout is off by the outputs themselves).
    atol, rtol = (1e-4, 0.0) if dtype == torch.float32 else (0.1, 0.02)
    results = []
    gen = torch.Generator().manual_seed(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(batch, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
        with torch.inference_mode():
            weights, experts = route(block.gate(x), block.top_k, block.renormalize)
            paths = {"grouped": partial(block.grouped, x, weights, experts)}
            if on_gpu:  # the engine takes one of these by the experts' size (SparseMoeBlock.kernel_suits)
                paths["kernel"] = partial(forced, True, x, weights, experts)
                paths["loop"] = partial(forced, False, x, weights, experts)
            paths["dense"] = partial(block.dense, x, weights, experts)
            if hf_experts is not None:
                paths["transformers"] = partial(hf_experts, x, experts, weights.to(dtype))
            reference = paths["dense"]()
            for path, fn in paths.items():
                torch.testing.assert_close(
                    fn(), reference, atol=atol, rtol=rtol, msg=lambda m, p=path: f"{p}: {m}"
                )
            row: dict[str, float] = {"batch": batch}
            for path, fn in paths.items():
                row[f"{path}_ms"] = round(median_ms(fn, args.repeats, device), 3)
        for path in paths:
            if path != "grouped":
                row[f"vs_{path}"] = round(row[f"{path}_ms"] / row["grouped_ms"], 2)
        log(
            f"batch {batch:4d}: grouped {row['grouped_ms']:.3f} ms; "
            + ", ".join(f"{p} {row[f'{p}_ms']:.3f} ms ({row[f'vs_{p}']}x)" for p in paths if p != "grouped")
        )
        results.append(row)
    at_64 = next((r for r in results if r["batch"] == 64), results[-1])
    print(
        json.dumps(
            {
                "bench": "moe_experts",
                "model": name,
                "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "packed": packed,
                "batches": results,
                **{f"batch64_{k}": v for k, v in at_64.items() if k.startswith("vs_")},
            }
        )
    )


if __name__ == "__main__":
    main()
