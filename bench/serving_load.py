"""Serving overhead: concurrent streaming chat clients through the full stack against the same workload
through the engine in-process, in one run.

Stack: the official AsyncOpenAI client -> daphne (config.asgi) -> Redis -> one engine replica
(`manage.py run_engine`), on PostgreSQL from DATABASE_URL or a throwaway SQLite, and Redis from
REDIS_URL or an embedded server (bench/_stack.py). Direct: LLMEngine with the same engine
configuration, driven by add_request/step in this process. Both see the same prompts (the chat
template rendered by the web tier's own tokenizer code), greedy sampling and ignore_eos, so every
request produces exactly --max-tokens tokens; both keep --concurrency requests in flight (a closed
loop: a finished request is replaced by the next one).

Two phases: high load (--concurrency clients, --requests requests) and low load (one client,
--low-load-requests requests), the latter to compare the median time to first token: the stack
should add at most 15 ms to the direct engine's. Time to first token is measured from sending the
request (direct: add_request) to the first token's chunk (direct: the step that produced it);
inter-token latency is the gap between consecutive chunks of one request.

    .venv/bin/python bench/serving_load.py                       # small model, 200 clients
    .venv/bin/python bench/serving_load.py --size tiny --concurrency 50 --requests 100

Prints progress on stderr and a final JSON line of figures on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stack import BenchStack, create_stack  # noqa: E402

TTFT_TARGET_MS = 15.0
# Words the demo tokenizer (trained on Python's standard library) knows well.
WORDS = (
    "def return self import value list the data file error class for in if else none true false name "
    "path result object string number index key dict type args kwargs test module function call time "
    "read write open close buffer stream line text encode decode socket thread lock queue event loop"
).split()


@dataclass
class Record:
    sent: float
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    def on_chunk(self, now: float, tokens: int = 1) -> None:
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.tokens += tokens


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


def summarize(records: list[Record], wall_s: float, max_tokens: int) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_kinds": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 2),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 1),
        "ttft_ms_p50": ms(percentile(ttft, 0.5)),
        "ttft_ms_p99": ms(percentile(ttft, 0.99)),
        "itl_ms_p50": ms(percentile(gaps, 0.5)),
        "itl_ms_p99": ms(percentile(gaps, 0.99)),
        "short_requests": sum(1 for r in ok if r.tokens != max_tokens),
    }


# --- the workload ----------------------------------------------------------------------------------


def make_prompts(tokenizer: Any, *, count: int, prompt_len: int, seed: int) -> list[str]:
    """User messages of about `prompt_len` tokens (the chat template adds a few more)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choices(WORDS, k=2 * prompt_len))
        ids = tokenizer.encode(text, add_special_tokens=False)[:prompt_len]
        prompts.append(tokenizer.decode(ids).strip())
    return prompts


def messages_of(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# --- through the stack ---------------------------------------------------------------------------


def stack_client(stack: BenchStack, concurrency: int):
    """The official AsyncOpenAI client on the stack's API with the benchmark tenant's key: no
    retries, a connection per client and to spare, and timeouts no run reaches."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    return openai.AsyncOpenAI(
        base_url=stack.api_base,
        api_key=stack.api_key,
        max_retries=0,
        timeout=600.0,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=limits, timeout=httpx2.Timeout(600.0, connect=60.0)
        ),
    )


async def stack_phase(
    stack: BenchStack, prompts: list[str], *, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    client = stack_client(stack, concurrency)
    records: list[Record] = []
    pending = iter(prompts)

    async def one(prompt: str) -> Record:
        record = Record(sent=time.perf_counter())
        usage_tokens = None
        try:
            stream = await client.chat.completions.create(
                model=stack.model,
                messages=messages_of(prompt),
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                # The first chunk only announces the role; the last only carries the finish reason.
                if choice.delta.role is not None or choice.finish_reason is not None:
                    continue
                record.on_chunk(time.perf_counter(), tokens=0)
            if usage_tokens is None:
                record.error = "no usage chunk"
            else:
                record.tokens = usage_tokens
        except Exception as exc:  # every failure is counted, by kind (and by its cause, for connections)
            cause = exc.__cause__ or exc.__context__
            record.error = f"{type(exc).__name__}: {str(exc)[:120]}" + (
                f" ({type(cause).__name__}: {str(cause)[:80]})" if cause is not None else ""
            )
        return record

    async def client_loop() -> None:
        for prompt in pending:
            records.append(await one(prompt))

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    await client.close()
    return summarize(records, wall, max_tokens)


# --- through the engine directly -----------------------------------------------------------------


def direct_engine(stack: BenchStack):
    """LLMEngine with exactly the configuration `run_engine` gives the stack's replica."""
    from engine.llm_engine import LLMEngine
    from engine.serve import build_parser, engine_config_from_args
    from inference.management.commands.run_engine import serve_argv
    from inference.models import ModelDeployment

    deployment = ModelDeployment.objects.get(name=stack.model)
    argv = serve_argv(
        name=deployment.name,
        model_path=deployment.model_path,
        max_model_len=deployment.max_model_len,
        dtype=deployment.dtype,
        engine_settings=dict(deployment.engine_settings),
    )
    args = build_parser().parse_args([*argv[3:], "--redis-url", "unused://"])
    return LLMEngine.from_config(engine_config_from_args(args))


def direct_phase(
    engine: Any, prompt_ids: list[list[int]], *, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams.from_dict(
        {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "n": 1, "stop": []}
    )
    waiting = deque(enumerate(prompt_ids))
    active: dict[str, Record] = {}
    records: list[Record] = []
    started = time.perf_counter()
    while waiting or active:
        while waiting and len(active) < concurrency:
            i, ids = waiting.popleft()
            request_id = f"direct-{started}-{i}"
            active[request_id] = Record(sent=time.perf_counter())
            engine.add_request(request_id, ids, params)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            record = active[out.request_id]
            produced = len(out.outputs[0].token_ids_delta)
            if produced:
                record.on_chunk(now, tokens=produced)
            if out.finished:
                if out.error:
                    record.error = out.error
                records.append(active.pop(out.request_id))
    wall = time.perf_counter() - started
    return summarize(records, wall, max_tokens)


# --- the run -------------------------------------------------------------------------------------


def model_dir_for(size: str) -> Path:
    from engine.make_model import make_model

    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda")) / "models"
    out = root / f"llama-{size}-float32-seed0"
    if not (out / "config.json").exists():
        make_model(out, arch="llama", size=size, seed=0, dtype="float32")
    return out


def log(message: str) -> None:
    print(f"[serving_load {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument(
        "--requests", type=int, default=None, help="high-load requests; default 2 x concurrency"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens of the user message")
    parser.add_argument("--low-load-requests", type=int, default=20)
    parser.add_argument("--size", choices=("tiny", "small"), default="small", help="the random-weight model")
    parser.add_argument("--model-dir", type=Path, default=None, help="serve this model directory instead")
    # Half the cores: the other half serve daphne and the clients. More intra-op threads than free
    # cores make every OpenMP barrier wait for a descheduled thread (10x slower steps on 2 busy cores).
    parser.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2), help="torch threads of each engine"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    num_requests = args.requests or 2 * args.concurrency

    model_dir = args.model_dir or model_dir_for(args.size)
    stack = create_stack(
        model_dir=model_dir,
        engine_settings={
            "device": "cpu" if args.model_dir is None else "auto",
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        max_queued=args.concurrency,  # the load offered: no client is refused for the queue bounds
    )
    try:
        from inference.tokenization import chat_prompt_ids, get_tokenizer

        tokenizer = get_tokenizer(str(model_dir))
        warmup = make_prompts(tokenizer, count=args.warmup, prompt_len=args.prompt_len, seed=args.seed + 1)
        high = make_prompts(tokenizer, count=num_requests, prompt_len=args.prompt_len, seed=args.seed + 2)
        low = make_prompts(
            tokenizer, count=args.low_load_requests, prompt_len=args.prompt_len, seed=args.seed + 3
        )
        ids = {p: chat_prompt_ids(str(model_dir), messages_of(p)) for p in [*warmup, *high, *low]}
        prompt_tokens = statistics.mean(len(ids[p]) for p in high)

        log(f"starting daphne and one engine replica of {model_dir.name} ({stack.work_dir})")
        stack.start(threads=args.threads)
        log("stack ready; warming up")
        asyncio.run(stack_phase(stack, warmup, concurrency=1, max_tokens=args.max_tokens))
        log(f"stack: {num_requests} requests from {args.concurrency} concurrent clients")
        stack_high = asyncio.run(
            stack_phase(stack, high, concurrency=args.concurrency, max_tokens=args.max_tokens)
        )
        log(f"stack high load: {json.dumps(stack_high)}")
        stack_low = asyncio.run(stack_phase(stack, low, concurrency=1, max_tokens=args.max_tokens))
        log(f"stack low load: {json.dumps(stack_low)}")
        stack.stop()

        import torch

        torch.set_num_threads(args.threads)
        engine = direct_engine(stack)
        log("direct engine loaded; warming up")
        direct_phase(engine, [ids[p] for p in warmup], concurrency=1, max_tokens=args.max_tokens)
        direct_high = direct_phase(
            engine, [ids[p] for p in high], concurrency=args.concurrency, max_tokens=args.max_tokens
        )
        log(f"direct high load: {json.dumps(direct_high)}")
        direct_low = direct_phase(engine, [ids[p] for p in low], concurrency=1, max_tokens=args.max_tokens)
        log(f"direct low load: {json.dumps(direct_low)}")
    except BaseException:
        log(f"failed; the stack's logs are in {stack.keep_logs()}")
        raise
    else:
        if stack_high["errors"] or stack_low["errors"]:
            log(f"the stack answered with errors; its logs are in {stack.keep_logs()}")
    finally:
        stack.close()

    ttft_over = None
    if stack_low["ttft_ms_p50"] is not None and direct_low["ttft_ms_p50"] is not None:
        ttft_over = round(stack_low["ttft_ms_p50"] - direct_low["ttft_ms_p50"], 2)
    result = {
        "bench": "serving_load",
        "model": model_dir.name,
        "concurrency": args.concurrency,
        "requests": num_requests,
        "max_tokens": args.max_tokens,
        "prompt_tokens_mean": round(prompt_tokens, 1),
        "threads": args.threads,
        "database": stack.database,
        "redis": stack.redis,
        "stack": stack_high,
        "direct": direct_high,
        # How much longer the stack takes for the same tokens (1.0: no overhead).
        "overhead_ratio": round(
            direct_high["output_tokens_per_s"] / max(stack_high["output_tokens_per_s"], 1e-9), 3
        ),
        "low_load": {
            "requests": args.low_load_requests,
            "stack": stack_low,
            "direct": direct_low,
            "ttft_ms_p50_over_direct": ttft_over,
            "ttft_target_ms": TTFT_TARGET_MS,
            "ttft_target_met": ttft_over is not None and ttft_over <= TTFT_TARGET_MS,
        },
        "errors": stack_high["errors"] + stack_low["errors"] + direct_high["errors"] + direct_low["errors"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
