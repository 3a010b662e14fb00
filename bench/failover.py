"""Failover: 16 streams on two engine replicas, one replica SIGKILLed mid-run.

The stack is the one users run (daphne, `manage.py run_engine` twice, Redis, the database), on
SmolLM2-135M-Instruct (real text; `--model random` for the random-weight bench model). One workload
of greedy chat streams (distinct questions, EOS ignored so each runs to max_tokens) runs twice
through the official openai client:
- undisturbed, as the baseline of every stream's text;
- again, with the replica holding more of them SIGKILLed once every stream has received
  --kill-after chunks.

Each stream records when each chunk arrived. A stream that the other replica took over (its output
stream has a failover marker) has a gap at the kill: the longest pause between two of its chunks.

Final JSON line: streams_completed (of --streams, ended with finish_reason length and no error),
text_mismatches (against the undisturbed run), streams_taken_over, gap_p50_s and gap_p99_s (over
the streams taken over), the undisturbed run's inter-chunk p50 and p99 beside them,
extra_prompt_tokens (what the continuations computed again: each one's prompt and the tokens it had
streamed, as the surviving replica reports), and the heartbeat TTL the gap is bounded by.
Targets: every stream completed, 0 mismatches, gap_p99_s <= heartbeat TTL + 2 s.

    .venv/bin/python bench/failover.py
    .venv/bin/python bench/failover.py --model random --max-tokens 128   # a quick run
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stack import create_stack  # noqa: E402
from bench.common import bench_model_dir, log, percentile, real_model_dir  # noqa: E402

QUESTIONS = [
    "Describe a pagoda to someone who has never seen one.",
    "Explain how bells are cast.",
    "Write a short story about a lighthouse keeper.",
    "What makes bread rise?",
    "Describe the water cycle.",
    "Tell me about the history of paper.",
    "How does a bicycle stay upright?",
    "Write a letter to a friend about autumn.",
    "Explain why the sky is blue.",
    "Describe a busy market in the morning.",
    "How do bees make honey?",
    "Write a poem about the sea.",
    "What is a compiler?",
    "Describe a train journey through the mountains.",
    "How do plants drink water?",
    "Tell me about the moon.",
]


@dataclass
class Stream:
    question: str
    request_id: str = ""
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def run_stream(
    client, model: str, stream: Stream, max_tokens: int, started: threading.Barrier | None
) -> Stream:
    import openai

    try:
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": stream.question}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        stream.request_id = response.response.headers["x-request-id"]
        for chunk in response:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                stream.arrivals.append(time.perf_counter())
                stream.text += choice.delta.content
            if choice.finish_reason:
                stream.finish_reason = choice.finish_reason
    except openai.APIError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream


def run_workload(stack, max_tokens: int, *, kill_after: int | None) -> tuple[list[Stream], str | None]:
    """The streams, and the replica killed (None: none was)."""
    import openai

    client = openai.OpenAI(base_url=stack.api_base, api_key=stack.api_key, max_retries=0, timeout=600)
    streams = [Stream(q) for q in QUESTIONS]
    victim = None
    with ThreadPoolExecutor(max_workers=len(streams)) as pool:
        futures = [pool.submit(run_stream, client, stack.model, s, max_tokens, None) for s in streams]
        if kill_after is not None:
            deadline = time.monotonic() + 600
            while not all(len(s.arrivals) >= kill_after or s.error or s.finish_reason for s in streams):
                if time.monotonic() > deadline:
                    raise RuntimeError("the streams did not start")
                time.sleep(0.01)
            held = holders(stack.model)
            victim = max(held, key=held.__getitem__)
            process = stack.processes["engine" if victim == "a" else f"engine-{victim}"]
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
            log(f"killed replica {victim} (holding {held}) with every stream past {kill_after} chunks")
        for future in futures:
            future.result()
    return streams, victim


def holders(model: str) -> dict[str, int]:
    """The requests each replica holds (taken, not answered yet)."""
    from django.conf import settings

    from core.redis_client import get_redis
    from engine.protocol import CONSUMER_GROUP, requests_stream

    summary = get_redis().xpending(requests_stream(settings.REDIS_PREFIX, model), CONSUMER_GROUP)
    return {
        (c["name"].decode() if isinstance(c["name"], bytes) else c["name"]): int(c["pending"])
        for c in summary.get("consumers") or ()
    }


def taken_over(request_id: str) -> bool:
    from django.conf import settings

    from core.redis_client import get_redis
    from engine.protocol import Event, output_stream

    entries = get_redis().xrange(output_stream(settings.REDIS_PREFIX, request_id))
    return any(Event.decode(fields).type == "failover" for _, fields in entries)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "random"], default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kill-after", type=int, default=16, help="chunks every stream has when a is killed")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    args = parser.parse_args()
    model_dir = real_model_dir() if args.model == "smollm2" else bench_model_dir()
    stack = create_stack(
        model_dir=model_dir,
        engine_settings={"max_num_seqs": len(QUESTIONS), "kv_cache_memory": "512MiB"},
        max_model_len=1024,
    )
    try:
        stack.start(threads=args.threads, replicas=("a", "b"))
        from django.conf import settings

        log("undisturbed run")
        baseline, _ = run_workload(stack, args.max_tokens, kill_after=None)
        log("run with replica a killed")
        disturbed, killed = run_workload(stack, args.max_tokens, kill_after=args.kill_after)
        from inference.selectors import deployment_replicas

        survivors = [s for s in deployment_replicas(name=stack.model) if s.replica_id != killed]
        survivor = survivors[0] if survivors else None
        over = [s for s in disturbed if s.request_id and taken_over(s.request_id)]
        gaps = [max(s.gaps) for s in over if s.gaps]
        baseline_gaps = [g for s in baseline for g in s.gaps]
        figures = {
            "model": args.model,
            "killed": killed,
            "streams": len(disturbed),
            "max_tokens": args.max_tokens,
            "streams_completed": sum(s.finish_reason == "length" and s.error is None for s in disturbed),
            "baseline_completed": sum(s.finish_reason == "length" and s.error is None for s in baseline),
            "text_mismatches": sum(a.text != b.text for a, b in zip(baseline, disturbed, strict=True)),
            "streams_taken_over": len(over),
            "gap_p50_s": round(percentile(gaps, 50), 3) if gaps else None,
            "gap_p99_s": round(percentile(gaps, 99), 3) if gaps else None,
            "baseline_itl_p50_s": round(percentile(baseline_gaps, 50), 4),
            "baseline_itl_p99_s": round(percentile(baseline_gaps, 99), 4),
            "extra_prompt_tokens": (
                None
                if survivor is None
                else survivor.num_resumed_tokens + sum(_prompt_tokens(s.request_id) for s in over)
            ),
            "resumed_output_tokens": None if survivor is None else survivor.num_resumed_tokens,
            "heartbeat_ttl_s": float(settings.ENGINE_HEARTBEAT_TTL),
            "errors": sorted({s.error for s in disturbed if s.error}),
        }
        print(json.dumps(figures), flush=True)
    except BaseException:
        log(f"logs kept in {stack.keep_logs()}")
        raise
    finally:
        stack.close()


def _prompt_tokens(request_id: str) -> int:
    from tenants.models import UsageRecord

    row = UsageRecord.objects.filter(request_id=request_id).first()
    return row.prompt_tokens if row is not None else 0


if __name__ == "__main__":
    main()
