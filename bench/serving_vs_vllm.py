"""Serving throughput: the full Pagoda stack against `vllm serve`, both driven by GuideLLM, in one run.

Pagoda: daphne (config.asgi) -> Redis -> one engine replica (`manage.py run_engine`), with API-key
auth, rate limits, queue bounds and metering on every request (a tenant whose limits are set but far
above the load), on PostgreSQL from DATABASE_URL or a throwaway SQLite, Redis from REDIS_URL or an
embedded server (bench/_stack.py). vLLM: `python -m vllm.entrypoints.openai.api_server` from its own
virtualenv (see bench/vs_vllm.py for how to make it), started with the same engine settings (model,
dtype, threads, max_num_seqs, max_num_batched_tokens, context length, KV cache size, prefix caching).

Both servers stay up for the whole run and each load profile is measured on one and then the other,
so both see the machine in the same state; with --rounds N every profile is measured N times, the
first server flipped every time, and each figure is the median of its rounds (this shared machine
has slow spells of minutes). An even N gives both servers the first place equally often: at 32
streams the server measured second was seen to get a worse inter-token latency. Every (round,
profile) has prompts of its own (GuideLLM's seed), the same for both servers, so no run finds an
earlier one's prompts in the prefix cache.

The load is GuideLLM's (a development dependency): streamed chat completions of synthetic prompts
of --prompt-tokens tokens, --output-tokens tokens each (ignore_eos), `concurrent` profiles at each
of --concurrency, after a warm-up, with --requests requests each but at least 4 x the concurrency.
Requests of equal lengths move in cohorts (those whose first tokens came out in one step), and a
profile of only 2 x its concurrency is two waves, whose first step and last cohort are a third of
it: at 32 streams, 64 requests put the median inter-token latency at the edge between fast and
slow cohorts, 1.15-1.31x vLLM's in every round measured, while 128 gave 0.92-1.08x in four rounds
(see the cohorts in bench/RESULTS.md). Goodput is the rate of requests meeting the SLO
(--slo-ttft-ms time to first token and --slo-itl-ms inter-token latency; defaults chosen for this
2-core CPU and a 135M model with prompts that are not in the prefix cache: a first token within
5 s and at most 200 ms between tokens).

With --cold, every (round, profile) starts each server afresh, one server at a time (the other is
not running), and GuideLLM sends the profile's requests as soon as the server reports ready
(Pagoda's /ready, vLLM's /health) and it has made its prompts, with no warm-up request: what users
see after a deploy or a scale-up. The figures then add the first wave's time to first token (the
profile's first `concurrency` requests, sent at once) and the server's start-up time.

    .venv/bin/python bench/serving_vs_vllm.py --vllm-python ~/.cache/pagoda/vllm-venv/bin/python
    .venv/bin/python bench/serving_vs_vllm.py --skip-vllm --concurrency 8
    .venv/bin/python bench/serving_vs_vllm.py --cold --rounds 1

Prints progress on stderr and a final JSON line on stdout with `output_tok_s_ratio` and
`itl_p50_ratio` (Pagoda over vLLM) at each concurrency and each side's figures; with --cold also
`first_wave_ttft_p95_ratio`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stack import BenchStack, create_stack, free_port  # noqa: E402
from bench.common import cpu_seconds, log, process_tree, real_model_dir, vllm_env  # noqa: E402

# GuideLLM's report: one benchmark per run, metrics as distributions keyed by kind of request.
METRICS = {
    "output_tok_s": ("output_tokens_per_second", "mean"),
    "ttft_ms": ("time_to_first_token_ms", None),
    "itl_ms": ("inter_token_latency_ms", None),
    "latency_s": ("request_latency", None),
    "requests_per_s": ("requests_per_second", "mean"),
}


class VllmServer:
    """`vllm serve` from its own virtualenv, with the engine settings Pagoda's replica gets."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, name: str, work_dir: Path) -> None:
        self.name = name
        self.api_key = "sk-bench-" + secrets.token_hex(8)
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        env = vllm_env(args.vllm_python, threads=args.threads, kv_cache_gib=args.kv_cache_gib)
        env.pop("PYTHONPATH", None)
        command = [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            name,
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-model-len",
            str(args.max_model_len),
            "--enable-prefix-caching",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            self.api_key,
        ]
        self.log_path = work_dir / "vllm.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                command, env=env, cwd=work_dir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve was not ready after {timeout_s}s:\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


@dataclass
class Side:
    """One server as the load sees it, and the processes whose CPU time is counted."""

    name: str
    target: str
    model: str
    api_key: str
    pids: dict[str, int]


def run_guidellm(
    side: Side,
    *,
    concurrency: int,
    round_: int,
    label: str,
    args: argparse.Namespace,
    tokenizer_dir: Path,
    out_dir: Path,
) -> dict[str, Any]:
    """One GuideLLM `concurrent` benchmark; returns its figures (see METRICS) and goodput. Each
    (round, concurrency) has prompts of its own, the same for both servers."""
    target, model, api_key, pids = side.target, side.model, side.api_key, side.pids
    requests = max(args.requests, 4 * concurrency)
    seed = args.seed + 1000 * round_ + concurrency
    report = out_dir / f"{label}.json"
    scenario = {
        "backend": {
            "kind": "openai_http",
            "target": target,
            "model": model,
            "api_key": api_key,
            "request_format": "/v1/chat/completions",
            "http2": False,
            "timeout": 600.0,
        },
        "profile": {"kind": "concurrent", "streams": [concurrency]},
        "data": [
            {
                "kind": "synthetic_text",
                "prompt_tokens": args.prompt_tokens,
                "output_tokens": args.output_tokens,
            }
        ],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
        "constraints": [{"kind": "max_requests", "count": requests}],
        "seed": {"kind": "static", "value": seed},
        "outputs": [{"kind": "json", "path": str(report)}],
        "metrics": {"kind": "generative", "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_itl_ms}},
    }
    scenario_path = out_dir / f"{label}.scenario.json"
    scenario_path.write_text(json.dumps({"metadata": {"name": label}, "spec": scenario}))
    guidellm = Path(sys.executable).parent / "guidellm"
    command = [str(guidellm), "run", "--scenario", str(scenario_path), "--disable-console-interactive"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cpu_before = cpu_seconds(pids)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.profile_timeout_s)
    cpu_after = cpu_seconds(pids)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(
            f"guidellm failed ({label}, exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    data = json.loads(report.read_text())
    out = figures(data, label=label)
    out["first_wave_ttft_ms"] = first_wave(data, concurrency)
    log(
        f"{label} cohorts (first token at s: requests x mean ITL ms): "
        + ", ".join(f"{c['first_token_s']}: {c['requests']} x {c['itl_mean_ms']}" for c in cohorts(data))
    )
    # Where the cores went: CPU seconds per request of each server process (and its children).
    done_requests = max(1, out["successful"])
    out["cpu_ms_per_request"] = {
        name: round((cpu_after[name] - cpu_before[name]) * 1000 / done_requests, 1) for name in pids
    }
    log(f"{label}: {json.dumps(out)}")
    return out


def figures(report: dict[str, Any], *, label: str) -> dict[str, Any]:
    benchmark = report["benchmarks"][-1]
    metrics = benchmark["metrics"]
    out: dict[str, Any] = {}
    for name, (key, stat) in METRICS.items():
        successful = metrics[key]["successful"]
        if stat is not None:
            out[name] = round(float(successful[stat]), 2)
        else:
            percentiles = successful["percentiles"]
            out[name] = {
                "p50": round(float(percentiles["p50"]), 2),
                "p99": round(float(percentiles["p99"]), 2),
                "mean": round(float(successful["mean"]), 2),
            }
    requests = metrics.get("request_totals") or {}
    out["successful"] = int(requests.get("successful", 0))
    out["errored"] = int(requests.get("errored", 0))
    out["incomplete"] = int(requests.get("incomplete", 0))
    # Goodput: requests per second that met every objective of the SLO, and their share.
    out["slo_attainment"] = round(float(metrics.get("slo_attainment") or 0.0), 3)
    goodput = (metrics.get("request_goodput") or {}).get("successful") or {}
    out["goodput_requests_per_s"] = round(float(goodput.get("mean") or 0.0), 3)
    return out


def first_wave(report: dict[str, Any], size: int) -> dict[str, float]:
    """Time to first token of the profile's first `size` requests (by when each was sent: a
    `concurrent` profile sends its first wave at once): p50, p95 and the slowest, in ms."""
    requests = report["benchmarks"][-1]["requests"]["successful"]
    firsts = sorted(
        (r["info"]["timings"]["request_start"], r["info"]["timings"]["first_token_iteration"])
        for r in requests
        if r["info"]["timings"].get("first_token_iteration") is not None
    )[:size]
    ttfts = sorted((first - start) * 1000 for start, first in firsts)
    if not ttfts:
        return {}
    return {
        "requests": len(ttfts),
        "p50": round(_percentile(ttfts, 0.50), 1),
        "p95": round(_percentile(ttfts, 0.95), 1),
        "max": round(ttfts[-1], 1),
    }


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def cohorts(report: dict[str, Any], gap_s: float = 0.05) -> list[dict[str, float]]:
    """Requests whose first tokens came out together (one engine step: within ``gap_s``), in order:
    when each cohort's first token came (seconds into the profile), its size and its requests' mean
    inter-token latency. All requests of a `concurrent` profile have the same lengths, so they move
    in cohorts, and a median over requests falls inside whichever cohort holds the middle request."""
    requests = report["benchmarks"][-1]["requests"]["successful"]
    timed = sorted(
        (r["info"]["timings"]["first_token_iteration"], r["inter_token_latency_ms"])
        for r in requests
        if r["info"]["timings"].get("first_token_iteration") is not None and r.get("inter_token_latency_ms")
    )
    if not timed:
        return []
    start = min(r["info"]["timings"]["request_start"] for r in requests)
    groups: list[list[tuple[float, float]]] = []
    for first, itl in timed:
        if groups and first - groups[-1][-1][0] <= gap_s:
            groups[-1].append((first, itl))
        else:
            groups.append([(first, itl)])
    return [
        {
            "first_token_s": round(g[0][0] - start, 2),
            "requests": len(g),
            "itl_mean_ms": round(statistics.fmean(itl for _, itl in g), 1),
        }
        for g in groups
    ]


def warm_up(target: str, model: str, api_key: str, count: int = 4) -> None:
    """A few short chat completions, so compilation, caches and connections are not measured."""
    for i in range(count):
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                "max_tokens": 16,
            }
        ).encode()
        request = urllib.request.Request(
            target + "/v1/chat/completions",
            data=body,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def median_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over a profile's rounds (each round's figures kept under "rounds")."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            # Keys of every round (a process's name may be missing from one).
            out[key] = {
                k: _median([r[key][k] for r in runs]) for k in value if all(k in r[key] for r in runs)
            }
        elif isinstance(value, int | float):
            out[key] = _median([r[key] for r in runs])
    out["rounds"] = runs
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def pagoda_side(stack: BenchStack) -> Side:
    """The stack, its processes and the Redis server it uses."""
    from core.redis_client import get_redis

    pids = {name: proc.pid for name, proc in stack.processes.items()}
    pids["redis"] = int(get_redis().info("server")["process_id"])
    return Side("pagoda", stack.base_url, stack.model, stack.api_key, pids)


def vllm_side(vllm: VllmServer) -> Side:
    """The API server (tokenization, chat template, HTTP, detokenization) and the engine core
    process(es) under it."""
    pids = {"api_server": -vllm.proc.pid}
    for child in process_tree(vllm.proc.pid)[1:]:
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{child}/comm").read_text().strip()
            # By name, not pid: a cold start's processes have new pids, and rounds are compared.
            pids[name if name not in pids else f"{name}:{child}"] = -child
    return Side("vllm", vllm.base_url, vllm.name, vllm.api_key, pids)


def measure_warm(
    args: argparse.Namespace,
    levels: list[int],
    model_dir: Path,
    stack: BenchStack,
    out_dir: Path,
    runs: dict[str, dict[int, list[dict[str, Any]]]],
) -> None:
    """Both servers started once, warmed up and kept up; every profile measured on each in turn."""
    vllm: VllmServer | None = None
    try:
        if not args.skip_vllm:
            log("starting vllm serve (about 90 s)")
            vllm = VllmServer(args, model_dir, stack.model, out_dir)
        log(f"starting daphne and one engine replica ({stack.work_dir})")
        stack.start(threads=args.threads)
        warm_up(stack.base_url, stack.model, stack.api_key)
        if vllm is not None:
            vllm.wait_ready(timeout_s=600)
            warm_up(vllm.base_url, vllm.name, vllm.api_key)
        log("both servers ready" if vllm else "stack ready")
        sides = [pagoda_side(stack)] + ([vllm_side(vllm)] if vllm is not None else [])
        for round_ in range(args.rounds):
            for i, level in enumerate(levels):
                # Taken in turn, the first server flipped every time: a slow spell of this shared
                # machine falls on both alike.
                for side in sides if (round_ + i) % 2 == 0 else sides[::-1]:
                    log(f"{side.name}: round {round_ + 1}, concurrency {level}")
                    runs[side.name][level].append(
                        run_guidellm(
                            side,
                            concurrency=level,
                            round_=round_,
                            label=f"{side.name}-r{round_}-c{level}",
                            args=args,
                            tokenizer_dir=model_dir,
                            out_dir=out_dir,
                        )
                    )
    finally:
        if vllm is not None:
            vllm.stop()
        stack.stop()


def measure_cold(
    args: argparse.Namespace,
    levels: list[int],
    model_dir: Path,
    stack: BenchStack,
    out_dir: Path,
    runs: dict[str, dict[int, list[dict[str, Any]]]],
) -> None:
    """Every (round, profile) on a server started for it alone, with no warm-up: the profile's
    first wave goes to a server that has just said it is ready. One server runs at a time."""
    names = ["pagoda"] if args.skip_vllm else ["pagoda", "vllm"]
    for round_ in range(args.rounds):
        for i, level in enumerate(levels):
            for name in names if (round_ + i) % 2 == 0 else names[::-1]:
                log(f"{name}: round {round_ + 1}, concurrency {level}, from a cold start")
                started = time.monotonic()
                vllm: VllmServer | None = None
                try:
                    if name == "pagoda":
                        # A replica id of its own: nothing of the last start's replica is seen.
                        stack.start(threads=args.threads, replicas=(f"cold-r{round_}-c{level}",))
                        side = pagoda_side(stack)
                    else:
                        vllm = VllmServer(args, model_dir, stack.model, out_dir)
                        vllm.wait_ready(timeout_s=600)
                        side = vllm_side(vllm)
                    startup_s = round(time.monotonic() - started, 1)
                    log(f"{name} ready {startup_s} s after its start")
                    figures = run_guidellm(
                        side,
                        concurrency=level,
                        round_=round_,
                        label=f"{name}-cold-r{round_}-c{level}",
                        args=args,
                        tokenizer_dir=model_dir,
                        out_dir=out_dir,
                    )
                finally:
                    if vllm is not None:
                        vllm.stop()
                    stack.stop()
                figures["startup_s"] = startup_s
                runs[name][level].append(figures)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/pagoda/vllm-venv/bin/python"))
    parser.add_argument("--skip-vllm", action="store_true", help="Pagoda alone (no ratios)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrent streams")
    parser.add_argument("--requests", type=int, default=48, help="per profile (at least 4 x concurrency)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=200.0)
    parser.add_argument("--threads", type=int, default=2, help="engine threads of each server")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="measurements of every profile per server (even: balanced order)",
    )
    parser.add_argument("--profile-timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="start each server afresh for every profile, with no warm-up, and report its first wave",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    model_dir = args.model_dir or real_model_dir()
    out_dir = Path(tempfile.mkdtemp(prefix="pagoda-serving-vs-vllm-"))

    stack: BenchStack = create_stack(
        model_dir=model_dir,
        engine_settings={
            "device": "cpu",
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_memory": f"{args.kv_cache_gib}GiB",
            "enable_lora": False,  # as vLLM is started: no adapters
        },
        dtype=args.dtype,
        max_model_len=args.max_model_len,
    )
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        "pagoda": {level: [] for level in levels},
        "vllm": {level: [] for level in levels},
    }
    try:
        if args.cold:
            measure_cold(args, levels, model_dir, stack, out_dir, runs)
        else:
            measure_warm(args, levels, model_dir, stack, out_dir, runs)
    finally:
        stack.close()

    summary: dict[str, Any] = {
        "benchmark": "serving_vs_vllm",
        "model": model_dir.name,
        "dtype": args.dtype,
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "database": stack.database,
        "rounds": args.rounds,
        "cold": args.cold,
        "pagoda": {level: median_figures(r) for level, r in runs["pagoda"].items() if r},
    }
    if not args.skip_vllm:
        summary["vllm"] = {level: median_figures(r) for level, r in runs["vllm"].items() if r}
        for level in levels:
            p, v = summary["pagoda"][level], summary["vllm"][level]
            summary[f"output_tok_s_ratio_c{level}"] = ratio(p["output_tok_s"], v["output_tok_s"])
            # Latencies, Pagoda over vLLM: at most 1.0 where Pagoda is no slower.
            summary[f"itl_p50_ratio_c{level}"] = ratio(p["itl_ms"]["p50"], v["itl_ms"]["p50"])
            summary[f"itl_mean_ratio_c{level}"] = ratio(p["itl_ms"]["mean"], v["itl_ms"]["mean"])
            summary[f"ttft_p50_ratio_c{level}"] = ratio(p["ttft_ms"]["p50"], v["ttft_ms"]["p50"])
            summary[f"first_wave_ttft_p95_ratio_c{level}"] = ratio(
                p["first_wave_ttft_ms"].get("p95"), v["first_wave_ttft_ms"].get("p95")
            )
            pairs = zip(runs["pagoda"][level], runs["vllm"][level], strict=True)
            summary[f"itl_p50_ratio_by_round_c{level}"] = [
                ratio(a["itl_ms"]["p50"], b["itl_ms"]["p50"]) for a, b in pairs
            ]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
