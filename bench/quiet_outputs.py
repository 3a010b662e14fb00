"""Non-streamed answers through the whole stack, their output published every step against quiet.

A request answered with one body (`stream` false: a JSON answer, a batch line) needs no token
before its last. Its replica publishes its first tokens at once, then the rest together at its end
or every `quiet_publish_s` (an engine setting, 1 s by default; 0: a delta every step, as a streamed
request gets). This benchmark runs the same closed-loop workload of non-streamed chat completions
(the official AsyncOpenAI client, greedy, EOS ignored, so every answer has --max-tokens tokens)
through daphne, Redis and one engine replica, with `quiet_publish_s=0` (`every_step`, the
baseline) and with the default (`quiet`), in alternating order over --rounds rounds (each mode on a
replica started afresh). Per mode (medians over rounds): output tokens/s, request latency p50/p99,
CPU time per request of the web process, the replica and Redis, and the XADDs per request (its
output stream's entries, plus its queue entry and the reader's wake-up); and how many answers are identical between the two modes (all, under greedy).

    .venv/bin/python bench/quiet_outputs.py
    .venv/bin/python bench/quiet_outputs.py --real-model --requests 64
    .venv/bin/python bench/quiet_outputs.py --size tiny --concurrency 8 --requests 32 --rounds 1

Prints progress on stderr and a final JSON line of figures on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stack import BenchStack, create_stack  # noqa: E402
from bench.common import cpu_seconds, log  # noqa: E402
from bench.serving_load import (  # noqa: E402
    make_prompts,
    messages_of,
    model_dir_for,
    percentile,
    stack_client,
)

MODES = {"every_step": 0.0, "quiet": None}  # quiet_publish_s (None: the default)


def redis_pid(stack: BenchStack) -> int | None:
    """The embedded redis-server's pid (None when the stack uses a Redis it did not start)."""
    pid_file = stack.work_dir / "redis.pid"
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def xadd_calls() -> int:
    from core.redis_client import get_redis

    return int(get_redis().info("commandstats").get("cmdstat_xadd", {}).get("calls", 0))


async def phase(
    stack: BenchStack, prompts: list[str], *, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    client = stack_client(stack, concurrency)
    texts: dict[str, str] = {}
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0
    pending = iter(prompts)

    async def client_loop() -> None:
        nonlocal tokens
        for prompt in pending:
            sent = time.perf_counter()
            try:
                answer = await client.chat.completions.create(
                    model=stack.model,
                    messages=messages_of(prompt),
                    max_tokens=max_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
            except Exception as exc:  # every failure is counted, by kind
                errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")
                continue
            latencies.append(time.perf_counter() - sent)
            texts[prompt] = answer.choices[0].message.content or ""
            tokens += answer.usage.completion_tokens if answer.usage else 0

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    await client.close()
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "error_kinds": sorted(set(errors))[:5],
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1),
        "latency_ms_p50": round(1000 * (percentile(latencies, 0.5) or 0), 1),
        "latency_ms_p99": round(1000 * (percentile(latencies, 0.99) or 0), 1),
        "texts": texts,
    }


def run_mode(stack: BenchStack, mode: str, args: argparse.Namespace, warmup: list[str], prompts: list[str]):
    from inference.models import ModelDeployment

    deployment = ModelDeployment.objects.get(name=stack.model)
    settings = dict(deployment.engine_settings or {})
    settings.pop("quiet_publish_s", None)
    if MODES[mode] is not None:
        settings["quiet_publish_s"] = MODES[mode]
    deployment.engine_settings = settings
    deployment.save(update_fields=["engine_settings"])
    stack.start(threads=args.threads)
    try:
        asyncio.run(phase(stack, warmup, concurrency=min(4, args.concurrency), max_tokens=args.max_tokens))
        # Negative: each process alone (bench.common.cpu_seconds).
        pids = {"web": -stack.processes["daphne"].pid, "engine": -stack.processes["engine"].pid}
        if (pid := redis_pid(stack)) is not None:
            pids["redis"] = -pid
        cpu_before = cpu_seconds(pids)
        xadds_before = xadd_calls()
        result = asyncio.run(phase(stack, prompts, concurrency=args.concurrency, max_tokens=args.max_tokens))
        done = max(result["requests"], 1)
        cpu_after = cpu_seconds(pids)
        result["cpu_ms_per_request"] = {
            name: round(1000 * (cpu_after[name] - cpu_before[name]) / done, 2) for name in pids
        }
        result["xadds_per_request"] = round((xadd_calls() - xadds_before) / done, 2)
    finally:
        stack.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=("tiny", "small"), default="small", help="the random-weight model")
    parser.add_argument("--model-dir", type=Path, default=None, help="serve this model directory instead")
    parser.add_argument("--real-model", action="store_true", help="serve SmolLM2-135M-Instruct (float32)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128, help="per mode and round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens of the user message")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="the replica's threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("httpx2").setLevel(logging.WARNING)

    if args.real_model:
        from bench.common import real_model_dir

        args.model_dir = real_model_dir()
    model_dir = args.model_dir or model_dir_for(args.size)
    stack = create_stack(
        model_dir=model_dir,
        engine_settings={"device": "cpu"},
        max_queued=args.concurrency,
    )
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        from inference.tokenization import get_tokenizer

        tokenizer = get_tokenizer(str(model_dir))
        warmup = make_prompts(tokenizer, count=4, prompt_len=args.prompt_len, seed=args.seed + 1)
        prompts = make_prompts(tokenizer, count=args.requests, prompt_len=args.prompt_len, seed=args.seed + 2)
        for round_ in range(args.rounds):
            order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
            for mode in order:
                log(f"round {round_}: {mode}, {args.requests} requests from {args.concurrency} clients")
                result = run_mode(stack, mode, args, warmup, prompts)
                log(
                    f"round {round_}: {mode}: "
                    + json.dumps({k: v for k, v in result.items() if k != "texts"})
                )
                runs[mode].append(result)
    except BaseException:
        log(f"failed; the stack's logs are in {stack.keep_logs()}")
        raise
    finally:
        stack.close()

    def median(mode: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[mode]), 2)

    summary: dict[str, Any] = {}
    for mode in MODES:
        summary[mode] = {
            key: median(mode, key)
            for key in ("output_tok_s", "latency_ms_p50", "latency_ms_p99", "xadds_per_request")
        }
        summary[mode]["cpu_ms_per_request"] = {
            name: round(statistics.median(r["cpu_ms_per_request"][name] for r in runs[mode]), 2)
            for name in runs[mode][0]["cpu_ms_per_request"]
        }
        summary[mode]["output_tok_s_by_round"] = [r["output_tok_s"] for r in runs[mode]]
        summary[mode]["errors"] = sum(r["errors"] for r in runs[mode])
    base, quiet = runs["every_step"][0]["texts"], runs["quiet"][0]["texts"]
    identical = sum(1 for p, text in base.items() if quiet.get(p) == text)
    print(
        json.dumps(
            {
                "bench": "quiet_outputs",
                "model": Path(model_dir).name,
                "concurrency": args.concurrency,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                **summary,
                "identical_answers": identical,
                "answers_compared": len(base),
                "output_tok_s_ratio": round(
                    summary["quiet"]["output_tok_s"] / summary["every_step"]["output_tok_s"], 3
                ),
                "web_cpu_ratio": round(
                    summary["quiet"]["cpu_ms_per_request"]["web"]
                    / max(summary["every_step"]["cpu_ms_per_request"]["web"], 1e-9),
                    3,
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
