"""Output tokens/s: the engine against transformers' generate with static padded batches.

One seeded workload (prompt lengths uniform in 32-512, output lengths uniform in 16-256, EOS ignored)
through both, on the ~32M-parameter random-weight benchmark model in float32, or with --real-model
on SmolLM2-135M-Instruct (float32) with prompts of real text; on CPU by default, or on a GPU
(--device cuda, both sides there, with --dtype; one warm-up run each before the clock starts, so
Triton's compiles and cuBLAS's choices are not timed; the engine's CUDA graphs are captured when it
is built). transformers runs batches of 16 in
arrival order, left-padded, each batch decoding until its longest request is done; only the
requested tokens count as output. The engine gets every request at once and schedules them
continuously. Prints each side's output tokens/s and the ratio, then a final JSON line.

    OMP_NUM_THREADS=2 .venv/bin/python bench/engine_throughput.py                  # 128 requests
    OMP_NUM_THREADS=2 .venv/bin/python bench/engine_throughput.py --num-requests 16   # a quick run
    OMP_NUM_THREADS=2 .venv/bin/python bench/engine_throughput.py --real-model --num-requests 64
    OMP_NUM_THREADS=2 .venv/bin/python bench/engine_throughput.py --arch qwen3       # another architecture
    python bench/engine_throughput.py --real-model --device cuda --dtype bfloat16 --num-requests 512
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
from common import PromptSource, bench_model_dir, log, num_parameters, real_model_dir  # noqa: E402

Request = tuple[list[int], int]  # (prompt token ids, output tokens)


def workload(n: int, seed: int, model_dir: Path, real_text: bool) -> list[Request]:
    rng = random.Random(seed)
    source = PromptSource(model_dir, rng, real_text=real_text)
    return [(source.take(rng.randint(32, 512)), rng.randint(16, 256)) for _ in range(n)]


def run_transformers(
    model_dir: Path, reqs: list[Request], batch_size: int, pad_id: int, device: str, dtype: str
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if device != "cpu":  # kernels chosen and loaded before the clock starts, as the engine's are
        _transformers_batches(model, reqs[:batch_size], batch_size, pad_id, device, quiet=True)
    start = time.perf_counter()
    _transformers_batches(model, reqs, batch_size, pad_id, device)
    return time.perf_counter() - start


def _transformers_batches(
    model, reqs: list[Request], batch_size: int, pad_id: int, device: str, quiet: bool = False
) -> None:
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
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad_id,
            )
        assert out.shape == (len(batch), width + new), out.shape
        if not quiet:
            log(f"transformers: batch {i // batch_size + 1} done at {time.perf_counter() - start:.1f}s")


def run_engine(
    model_dir: Path, reqs: list[Request], args: argparse.Namespace
) -> tuple[float, int, int, bool]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    built = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_mib * 1024**2,
        enforce_eager=args.enforce_eager,
    )
    graphs = llm.engine.runner.graphs
    log(
        f"engine built in {time.perf_counter() - built:.1f}s"
        + (f", {len(graphs.sizes)} decode CUDA graphs up to batch {graphs.sizes[-1]}" if graphs else "")
    )
    from engine.step_profile import StepProfile

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    if args.device != "cpu":
        # The Triton kernels compiled before the clock starts; on reversed prompts, which leave no
        # prefix in the cache for the timed run to find.
        llm.generate([p[::-1] for p, _ in reqs[:16]], params[:16])
    profile = llm.engine.profile = StepProfile()
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    log(f"engine step profile:\n{profile.table()}")
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, produced, llm.engine.num_steps, graphs is not None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' static batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: both sides on the GPU")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in the engine")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--size", default="bench", help="engine.make_model size of the built model")
    parser.add_argument("--arch", default="llama", help="engine.make_model architecture of the built model")
    parser.add_argument("--model-dir", type=Path, default=None, help="an existing model directory instead")
    parser.add_argument(
        "--real-model",
        action="store_true",
        help="SmolLM2-135M-Instruct on prompts of real text (fetched once)",
    )
    args = parser.parse_args()
    from engine.allocator import reexec_as_engine_process

    reexec_as_engine_process(sys.argv)  # as an engine process runs (engine.allocator)
    torch.set_num_threads(args.threads)
    model_dir = (
        real_model_dir()
        if args.real_model
        else (args.model_dir or bench_model_dir(arch=args.arch, size=args.size))
    )
    reqs = workload(args.num_requests, args.seed, model_dir, real_text=args.real_model)
    pad_id = (
        2 if args.real_model else 5
    )  # the padding token: SmolLM2's <|im_end|>, the made-up models' <|pad|>
    wanted = sum(n for _, n in reqs)
    result: dict[str, object] = {
        "bench": "engine_throughput",
        "model": model_dir.name,
        "prompts": "real text" if args.real_model else "random token ids",
        "params_m": round(num_parameters(model_dir) / 1e6, 1),
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "cuda_graphs": False,  # whether the engine captured them (not for Gemma or the MoE models)
        "threads": args.threads,
        "num_requests": len(reqs),
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": wanted,
    }
    if not args.skip_engine:
        engine_s, produced, steps, graphed = run_engine(model_dir, reqs, args)
        assert produced == wanted, (produced, wanted)
        result.update(
            cuda_graphs=graphed,
            engine_s=round(engine_s, 2),
            engine_steps=steps,
            engine_tok_s=round(wanted / engine_s, 1),
        )
        print(
            f"engine:       {wanted} output tokens in {engine_s:.1f}s = {wanted / engine_s:.1f} tok/s",
            flush=True,
        )
    if not args.skip_transformers:
        hf_s = run_transformers(model_dir, reqs, args.batch_size, pad_id, args.device, args.dtype)
        result.update(transformers_s=round(hf_s, 2), transformers_tok_s=round(wanted / hf_s, 1))
        print(f"transformers: {wanted} output tokens in {hf_s:.1f}s = {wanted / hf_s:.1f} tok/s", flush=True)
    if "engine_s" in result and "transformers_s" in result:
        result["ratio"] = round(hf_s / engine_s, 2)
        print(f"engine / transformers: {result['ratio']}x", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
