"""Prefix-aware routing across replicas: multi-turn conversations through the whole stack (daphne,
engine replicas), three ways on the same workload:

  prefix   two replicas, each pinned to one core (one thread each), prefix routing on
  shared   the same two replicas reading one shared queue (the deployment's prefix_routing off)
  single   one replica on both cores (two threads)

The workload: --conversations chat conversations of --turns turns, --concurrency at a time, each
turn streamed (greedy, --max-tokens answer tokens, EOS ignored). Every conversation starts with the
same system prompt (about --system-tokens tokens of real text); each user message is about
--user-tokens tokens of real text; the assistant's answers are the model's own, so each turn's
prompt is the last one's history with the answer and the next message.

Reported per way: the cached-token share of prompt tokens (usage.prompt_tokens_details), TTFT p50
and p90, a whole turn's latency p50 and p90, output tok/s over the run, and steals (requests a replica took from another one's queue,
from the replicas' heartbeats). Targets, prefix routing against the shared queue: cached share >=
0.9x the single replica's, TTFT p50 <= 0.6x, output tok/s >= 1.0x.

    .venv/bin/python bench/multi_replica.py                  # SmolLM2-135M-Instruct
    .venv/bin/python bench/multi_replica.py --model bench    # the random-weight bench model

Prints progress on stderr and a final JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import random
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stack import (  # noqa: E402
    BenchStack,
    add_engine_setting_option,
    create_stack,
    engine_settings_from,
)
from bench.common import bench_model_dir, log, percentile, real_model_dir  # noqa: E402

WAYS = ("prefix", "shared", "single")


def _texts(rng: random.Random, count: int, chars: int) -> list[str]:
    """Windows of real text (the Python standard library's sources, on every machine)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:80]
    corpus = "\n".join(Path(f).read_text(errors="replace") for f in files)
    out = []
    for _ in range(count):
        start = rng.randrange(0, len(corpus) - chars)
        out.append(corpus[start : start + chars])
    return out


def _workload(args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    """The system prompt, and each conversation's user messages (about 4 characters a token)."""
    rng = random.Random(args.seed)
    system = (
        "You are a careful code reviewer. Read the code the user sends and explain it.\n"
        + _texts(rng, 1, 4 * args.system_tokens)[0]
    )
    users = [_texts(rng, args.turns, 4 * args.user_tokens) for _ in range(args.conversations)]
    return system, users


class Run:
    def __init__(self, client: Any, model: str, args: argparse.Namespace) -> None:
        self.client, self.model, self.args = client, model, args
        self.ttfts: list[float] = []
        self.latencies: list[float] = []  # a whole turn, to its last token
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def turn(self, messages: list[dict[str, str]]) -> str:
        start = time.perf_counter()
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=self.args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, ttft, usage = [], None, None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        with self.lock:
            self.latencies.append(time.perf_counter() - start)
            if ttft is not None:
                self.ttfts.append(ttft)
            if usage is not None:
                self.prompt_tokens += usage.prompt_tokens
                self.cached_tokens += usage.prompt_tokens_details.cached_tokens
                self.output_tokens += usage.completion_tokens
        return "".join(text)

    def conversation(self, system: str, users: list[str]) -> None:
        messages = [{"role": "system", "content": system}]
        for user in users:
            messages.append({"role": "user", "content": user})
            try:
                answer = self.turn(messages)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                self.errors.append(repr(exc))
                return
            messages.append({"role": "assistant", "content": answer})


def _steals(model: str) -> tuple[int, list[int]]:
    """Requests stolen, and each replica's routed requests (from the replicas' heartbeats)."""
    from inference.gateway.replicas import replica_stats_list

    stats = replica_stats_list(model)
    return sum(s.num_stolen_requests for s in stats), [s.num_routed_requests for s in stats]


def run_way(stack: BenchStack, way: str, system: str, users: list[list[str]], args) -> dict[str, Any]:
    import openai

    from inference.models import ModelDeployment

    ModelDeployment.objects.filter(name=stack.model).update(prefix_routing=way != "shared")
    stack.processes.clear()
    if way == "single":
        stack.start(threads=2, replicas=(f"{way}-solo",))
    else:
        replicas = (f"{way}-a", f"{way}-b")
        stack.start(threads=1, replicas=replicas, cpus={replicas[0]: "0", replicas[1]: "1"})
    try:
        client = openai.OpenAI(base_url=stack.api_base, api_key=stack.api_key, max_retries=0, timeout=600)
        # One short request first: the stack's first request pays for loading what is loaded lazily.
        client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=2
        )
        run = Run(client, stack.model, args)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda u: run.conversation(system, u), users))
        seconds = time.perf_counter() - started
        time.sleep(1.5)  # a heartbeat after the last request: the replicas' counts are final
        steals, routed = _steals(stack.model)
    finally:
        stack.stop()
    if run.errors:
        log(f"{way}: {len(run.errors)} errors, first: {run.errors[0]}")
    figures = {
        "cached_share": round(run.cached_tokens / run.prompt_tokens, 3) if run.prompt_tokens else 0.0,
        "p50_ttft_ms": round(1000 * percentile(run.ttfts, 50), 1),
        "p90_ttft_ms": round(1000 * percentile(run.ttfts, 90), 1),
        "p50_turn_s": round(percentile(run.latencies, 50), 2),
        "p90_turn_s": round(percentile(run.latencies, 90), 2),
        "output_tok_s": round(run.output_tokens / seconds, 1),
        "prompt_tokens": run.prompt_tokens,
        "cached_tokens": run.cached_tokens,
        "turns": len(run.ttfts),
        "errors": len(run.errors),
        "seconds": round(seconds, 1),
        "steals": steals,
        "routed": routed,
    }
    log(f"{way}: {json.dumps(figures)}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("smollm2", "bench"), default="smollm2")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=120)
    parser.add_argument("--user-tokens", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--seed", type=int, default=0)
    add_engine_setting_option(
        parser, help="a deployment engine_settings entry (JSON value) for every way, repeatable"
    )
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    ways = [w for w in args.ways.split(",") if w]
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways: {sorted(unknown)}")

    model_dir = real_model_dir() if args.model == "smollm2" else bench_model_dir()
    engine_settings = engine_settings_from(
        args.engine_setting, {"max_num_seqs": 16, "kv_cache_memory": "1GiB"}
    )
    stack = create_stack(
        model_dir=model_dir,
        engine_settings=engine_settings,
        max_queued=max(64, 4 * args.concurrency),
    )
    system, users = _workload(args)
    figures: dict[str, Any] = {
        "model": args.model,
        "conversations": args.conversations,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "engine_settings": engine_settings,
    }
    try:
        for way in ways:
            log(f"{way}: starting")
            figures[way] = run_way(stack, way, system, users, args)
        if "prefix" in figures and "shared" in figures:
            prefix, shared = figures["prefix"], figures["shared"]
            figures["ttft_p50_vs_shared"] = round(prefix["p50_ttft_ms"] / shared["p50_ttft_ms"], 3)
            figures["ttft_p90_vs_shared"] = round(prefix["p90_ttft_ms"] / shared["p90_ttft_ms"], 3)
            figures["turn_p50_vs_shared"] = round(prefix["p50_turn_s"] / shared["p50_turn_s"], 3)
            figures["throughput_vs_shared"] = round(prefix["output_tok_s"] / shared["output_tok_s"], 3)
            if "single" in figures and figures["single"]["cached_share"]:
                figures["cached_share_vs_single"] = round(
                    prefix["cached_share"] / figures["single"]["cached_share"], 3
                )
    except BaseException:
        log(f"failed; the stack's logs are in {stack.keep_logs()}")
        raise
    finally:
        stack.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
