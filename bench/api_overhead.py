"""The same greedy chat workload through each wire format of the full stack, streamed: OpenAI's chat
completions (the baseline), OpenAI's Responses API (stored, its default) and Anthropic's Messages
API, with the official SDKs (AsyncOpenAI, AsyncAnthropic) against one stack (daphne, Redis, one engine replica of SmolLM2-135M-Instruct;
bench/_stack.py).

Two phases, the APIs taking turns so that a slow spell of this shared machine falls on both:
- load: --concurrency clients in a closed loop over --requests requests per API, per round
  (--rounds rounds, the order of the APIs rotated each round): output tokens/s (median over the
  rounds) and time to first token p50/p99;
- low load: one request at a time, the APIs taking turns (--low-load-requests each): time to
  first token p50, the figure a format's own overhead shows in.

All APIs run the same prompts with temperature 0, so the outputs must be the same texts; the run
says whether they were. Prints progress on stderr and a final JSON line: each API's figures and
the ratios against chat completions.

    .venv/bin/python bench/api_overhead.py
    .venv/bin/python bench/api_overhead.py --requests 16 --rounds 1 --low-load-requests 8   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, percentile, real_model_dir  # noqa: E402

from bench._stack import create_stack  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning to cook.",
    "Explain what a rainbow is in two sentences.",
    "Name four animals that live in the ocean.",
    "What should I pack for a day at the beach?",
    "Describe a sunset over the mountains.",
    "Why do cats purr?",
]


async def chat_once(client: Any, model: str, text: str, max_tokens: int) -> tuple[float, str, int]:
    """(seconds to the first text, the text, output tokens) of one streamed chat completion."""
    started = time.perf_counter()
    first, parts, tokens = None, [], 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first or 0.0, "".join(parts), tokens


async def messages_once(client: Any, model: str, text: str, max_tokens: int) -> tuple[float, str, int]:
    """The same for one streamed Anthropic message."""
    started = time.perf_counter()
    first, parts = None, []
    async with client.messages.stream(
        model=model,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": text}],
        extra_body={"temperature": 0},  # the current SDK has no temperature argument
    ) as stream:
        async for piece in stream.text_stream:
            if first is None:
                first = time.perf_counter() - started
            parts.append(piece)
        final = await stream.get_final_message()
    return first or 0.0, "".join(parts), final.usage.output_tokens


async def responses_once(client: Any, model: str, text: str, max_tokens: int) -> tuple[float, str, int]:
    """The same for one streamed response (stored, as the SDK's default asks)."""
    started = time.perf_counter()
    first, parts, tokens = None, [], 0
    stream = await client.responses.create(
        model=model, input=text, temperature=0, max_output_tokens=max_tokens, stream=True
    )
    async for event in stream:
        if event.type == "response.output_text.delta":
            if first is None:
                first = time.perf_counter() - started
            parts.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            tokens = event.response.usage.output_tokens
    return first or 0.0, "".join(parts), tokens


async def load_phase(call, count: int, concurrency: int) -> dict[str, Any]:
    pending = list(range(count))
    results: dict[int, tuple[float, str, int]] = {}

    async def worker() -> None:
        while pending:
            i = pending.pop(0)
            results[i] = await call(QUESTIONS[i % len(QUESTIONS)])

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    ttfts = [results[i][0] for i in range(count)]
    return {
        "seconds": elapsed,
        "tokens": sum(results[i][2] for i in range(count)),
        "ttfts": ttfts,
        "texts": [results[i][1] for i in range(count)],
    }


async def run(args: argparse.Namespace, stack: Any) -> dict[str, Any]:
    import anthropic
    import openai

    chat_client = openai.AsyncOpenAI(
        base_url=stack.api_base, api_key=stack.api_key, max_retries=0, timeout=600
    )
    messages_client = anthropic.AsyncAnthropic(
        base_url=stack.api_base.removesuffix("/v1"), api_key=stack.api_key, max_retries=0, timeout=600
    )
    calls = {
        "chat_completions": lambda text: chat_once(chat_client, stack.model, text, args.max_tokens),
        "responses": lambda text: responses_once(chat_client, stack.model, text, args.max_tokens),
        "messages": lambda text: messages_once(messages_client, stack.model, text, args.max_tokens),
    }
    names = list(calls)
    # Warm-up: the tokenizer, the chat template and the engine's first steps, for each.
    for call in calls.values():
        await call(QUESTIONS[0])
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in calls}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            result = await load_phase(calls[name], args.requests, args.concurrency)
            rounds[name].append(result)
            log(f"round {r + 1} {name}: {result['tokens'] / result['seconds']:.1f} tok/s")
    low: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(args.low_load_requests):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            ttft, _, _ = await calls[name](QUESTIONS[i % len(QUESTIONS)])
            low[name].append(ttft)
    figures: dict[str, Any] = {}
    for name in calls:
        ttfts = [t for result in rounds[name] for t in result["ttfts"]]
        figures[name] = {
            "output_tok_s": round(statistics.median(x["tokens"] / x["seconds"] for x in rounds[name]), 1),
            "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
            "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
            "low_load_ttft_p50_ms": round(1000 * percentile(low[name], 50), 1),
        }
    base = figures["chat_completions"]
    ratios: dict[str, Any] = {}
    for name in names[1:]:
        other = figures[name]
        ratios[f"{name}_throughput_ratio"] = round(other["output_tok_s"] / base["output_tok_s"], 3)
        ratios[f"{name}_low_load_ttft_added_ms"] = round(
            other["low_load_ttft_p50_ms"] - base["low_load_ttft_p50_ms"], 1
        )
    return {
        **figures,
        **ratios,
        "same_texts": all(
            rounds[name][-1]["texts"] == rounds["chat_completions"][-1]["texts"] for name in names[1:]
        ),
        "concurrency": args.concurrency,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=48, help="requests per API per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--low-load-requests", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    args = parser.parse_args()
    model_dir = real_model_dir()
    stack = create_stack(
        model_dir=model_dir,
        engine_settings={"max_num_seqs": 64, "kv_cache_memory": "1GiB"},
        max_queued=args.concurrency * 2,
    )
    try:
        log(f"starting daphne and one engine replica of {model_dir.name} ({stack.work_dir})")
        stack.start(threads=args.threads)
        figures = asyncio.run(run(args, stack))
    except BaseException:
        log(f"failed; the stack's logs are in {stack.keep_logs()}")
        raise
    finally:
        stack.stop()
        stack.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
