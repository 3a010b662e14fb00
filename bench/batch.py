"""The Batch API on spare capacity: one tenant's batch of --requests lines beside a second tenant's
interactive load, on one engine replica, through the whole stack (daphne, the engine, a Celery
worker on the `batches` queue and Celery beat).

Every request, interactive or batch line, is a completion of --prompt-tokens prompt tokens (token
ids, so both sides ask the same work of the engine) and --max-tokens output tokens, greedy, EOS
ignored. The interactive tenant runs --clients closed-loop streaming clients with --think-s of pause
between requests (a load that leaves capacity spare). Phases, one after the other:

  capacity        the same requests from --saturate clients at once, no pause: what the engine
                  turns out when it is busy (output tok/s).
  alone           the interactive load alone for --duration-s: its p90 TTFT and output tok/s.
  with_batch      the batch created, the same interactive load until the batch ends: the
                  interactive p90 TTFT and output tok/s again, and the batch's completion time and
                  output tok/s.
  alone_again     the interactive load alone once more,
  capacity_again  and the engine saturated once more: the machine's drift over the run.

The baselines are those of both sides of the batch: the alone p90 TTFT is that of the two alone
phases' requests together, and the capacity the mean of the two capacity phases (on a shared
machine either moves by a tenth or more over a few minutes). The batch's share of spare capacity
is its output tok/s over (capacity - interactive output tok/s during the batch). Targets:
interactive p90 TTFT within 1.2x of alone; batch share >= 0.8.

    .venv/bin/python bench/batch.py                      # the bench random-weight model
    .venv/bin/python bench/batch.py --model smollm2      # SmolLM2-135M

Each phase's `ttft_parts_ms` takes the interactive TTFT apart (mean and p90 of each part, from the
replica's timing of each request, engine.protocol.Event.timing): `web_in` (the client's call to the
web tier queueing the request), `queue` (to the replica taking it: the step under way when it
arrived), `engine` (to the end of the step that produced its first token), `web_out` (to the
client reading it). The means add up to the mean TTFT.

The JSON also gives the replica's measured step cost (`step_fixed_rows`: the shared step width's
fixed cost, in decode rows, from its start-up probe) and `interrupted_steps` (batch steps given up
between layers for an interactive arrival, engine.step_interrupt). `--engine-setting
no_step_interrupts=true` runs without them.

Prints progress on stderr and a final JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._stack import (  # noqa: E402
    ROOT,
    UNTHROTTLED,
    add_engine_setting_option,
    create_stack,
    engine_settings_from,
)
from bench.common import PromptSource, bench_model_dir, cpu_seconds, log, percentile, real_model_dir  # noqa: E402


def _body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _sdk_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The body as the SDK's arguments: vLLM's ignore_eos goes in extra_body."""
    fields = dict(body)
    extra = {"ignore_eos": fields.pop("ignore_eos")}
    return {**fields, "extra_body": extra}


class InteractiveLoad:
    """Closed-loop streaming clients: TTFT per request, and each request's output tokens counted when
    it ends (tok/s over a phase: the tokens of the requests that ended in it).

    Each request's TTFT is also taken apart, from the replica's finished event (its `timing`, the
    last entry of the request's output stream): `web_in` (sent -> the web tier queued it), `queue` (->
    the replica took it), `engine` (-> the step with its first token ended), `web_out` (-> the
    client read that token)."""

    def __init__(
        self, client: Any, model: str, prompts: list[list[int]], max_tokens: int, think_s: float
    ) -> None:
        self.client, self.model, self.prompts = client, model, prompts
        self.max_tokens, self.think_s = max_tokens, think_s
        self.ttfts: list[float] = []
        self.parts: list[dict[str, float]] = []
        self.cleared = 0  # clear() calls: a request's parts count where its TTFT did
        self.tokens: list[tuple[float, int]] = []  # (when a request ended, its output tokens)
        self.stop = threading.Event()
        self.errors: list[str] = []

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            start, sent = time.perf_counter(), time.time()
            first_at, request_id, counted_in = None, None, None
            try:
                stream = self.client.completions.create(
                    stream=True,
                    stream_options={"include_usage": True},
                    **_sdk_kwargs(_body(self.model, rng.choice(self.prompts), self.max_tokens)),
                )
                for chunk in stream:
                    now = time.perf_counter()
                    if first_at is None and chunk.choices and chunk.choices[0].text:
                        first_at = time.time()
                        request_id = chunk.id.removeprefix("cmpl-")
                        self.ttfts.append(now - start)
                        counted_in = self.cleared
                    if chunk.usage is not None:  # the last chunk: the request's output tokens
                        self.tokens.append((now, chunk.usage.completion_tokens))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                self.errors.append(repr(exc))
            if counted_in is not None and request_id is not None:
                parts = _ttft_parts(request_id, sent, first_at)
                if parts is not None and counted_in == self.cleared:
                    self.parts.append(parts)
            self.stop.wait(self.think_s)

    def clear(self) -> None:
        self.cleared += 1
        self.ttfts.clear()
        self.parts.clear()

    def run(self, clients: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        return threads

    def figures(self, since: float, until: float) -> dict[str, Any]:
        count = sum(n for t, n in self.tokens if since <= t < until)
        return {
            "p90_ttft_ms": round(1000 * percentile(self.ttfts, 90), 1) if self.ttfts else 0.0,
            "p50_ttft_ms": round(1000 * percentile(self.ttfts, 50), 1) if self.ttfts else 0.0,
            "output_tok_s": round(count / (until - since), 1),
            "requests": len(self.ttfts),
            "ttft_parts_ms": parts_figures(self.parts),
        }


TTFT_PARTS = ("web_in", "queue", "engine", "web_out")


def _ttft_parts(request_id: str, sent: float, first_at: float | None) -> dict[str, float] | None:
    """A request's TTFT taken apart (seconds), from the finished event at the end of its output
    stream; None when that is not there (an error) or has no first token."""
    from django.conf import settings

    from core.redis_client import get_redis
    from engine.protocol import Event, output_stream

    last = get_redis().xrevrange(output_stream(settings.REDIS_PREFIX, request_id), count=1)
    timing = Event.decode(last[0][1]).timing if last else None
    if not timing or "first_token" not in timing or first_at is None:
        return None
    return {
        "web_in": timing["queued"] - sent,
        "queue": timing["taken"] - timing["queued"],
        "engine": timing["first_token"] - timing["taken"],
        "web_out": first_at - timing["first_token"],
    }


def parts_figures(parts: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean (the means add up to the mean TTFT) and p90 of each part, in ms."""
    if not parts:
        return {}
    return {
        name: {
            "mean": round(1000 * sum(p[name] for p in parts) / len(parts), 1),
            "p90": round(1000 * percentile([p[name] for p in parts], 90), 1),
        }
        for name in TTFT_PARTS
    }


def _phase(
    client, model, prompts, args, *, clients: int, think_s: float, until
) -> tuple[dict[str, Any], list[float], list[dict[str, float]]]:
    """The phase's figures, its requests' TTFTs (seconds) and their parts."""
    load = InteractiveLoad(client, model, prompts, args.max_tokens, think_s)
    started = time.perf_counter()
    threads = load.run(clients)
    time.sleep(2.0)  # warm-up: the first requests' TTFTs are left out
    load.clear()
    since = time.perf_counter()
    until()
    end = time.perf_counter()
    load.stop.set()
    for thread in threads:
        thread.join(timeout=120)
    if load.errors:
        log(f"{len(load.errors)} interactive errors, first: {load.errors[0]}")
    figures = load.figures(since, end)
    figures["seconds"] = round(end - started, 1)
    return figures, list(load.ttfts), list(load.parts)


def _both_sides(
    before: dict[str, Any], after: dict[str, Any], ttfts: list[float], parts: list[dict[str, float]]
) -> dict[str, Any]:
    """A baseline from the phases on both sides of the batch: TTFT percentiles over all their
    requests, output tok/s their mean."""
    return {
        "p90_ttft_ms": round(1000 * percentile(ttfts, 90), 1) if ttfts else 0.0,
        "p50_ttft_ms": round(1000 * percentile(ttfts, 50), 1) if ttfts else 0.0,
        "output_tok_s": round((before["output_tok_s"] + after["output_tok_s"]) / 2, 1),
        "requests": len(ttfts),
        "ttft_parts_ms": parts_figures(parts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("bench", "smollm2"), default="bench")
    parser.add_argument("--requests", type=int, default=1000, help="batch lines")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, default=2, help="interactive streaming clients")
    parser.add_argument("--think-s", type=float, default=0.5)
    parser.add_argument(
        "--saturate", type=int, default=32, help="clients of the capacity phase (the replica's max_num_seqs)"
    )
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--runner-nice", type=int, default=10, help="nice value of the batch runner (scripts/up.sh: 10)"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=32,
        help="PAGODA_BATCH_MAX_IN_FLIGHT (the batch may fill the replica)",
    )
    add_engine_setting_option(parser, help="a deployment engine_settings entry (JSON value), repeatable")
    args = parser.parse_args()

    import openai

    model_dir = real_model_dir() if args.model == "smollm2" else bench_model_dir()
    os.environ["PAGODA_BATCH_MAX_IN_FLIGHT"] = str(args.in_flight)
    os.environ["PAGODA_BATCH_RESUME_EVERY_SECONDS"] = "2"
    stack = create_stack(
        model_dir=model_dir,
        engine_settings=engine_settings_from(
            args.engine_setting, {"max_num_seqs": 32, "kv_cache_memory": "1GiB"}
        ),
        max_queued=max(64, args.saturate * 2, args.in_flight * 2),
    )
    os.environ["PAGODA_MEDIA_DIR"] = str(stack.work_dir / "media")
    from tenants.services import api_key_create, tenant_create

    other = tenant_create(
        name=f"Interactive {stack.run_id}",
        slug=f"interactive-{stack.run_id}",
        allowed_models=[stack.model],
        **UNTHROTTLED,
        max_queued_requests=max(64, args.saturate * 2),
    )
    _, interactive_key = api_key_create(tenant=other, name="interactive")
    figures: dict[str, Any] = {"model": args.model, "requests": args.requests, "threads": args.threads}
    try:
        log(f"starting the stack ({stack.work_dir})")
        stack.start(threads=args.threads)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for name, argv in {
            "celery-batches": ["worker", "-Q", "batches,celery", "--pool=solo", "--loglevel=info"],
            "celery-beat": ["beat", "--loglevel=warning", f"--schedule={stack.work_dir / 'beat-schedule'}"],
        }.items():
            with open(stack.log_path(name), "wb") as out:
                # The runner is background work, as scripts/up.sh runs it: at a lower CPU priority
                # than the engine and the web process on a machine they share.
                stack.processes[name] = subprocess.Popen(
                    ["nice", "-n", str(args.runner_nice), sys.executable, "-m", "celery", "-A", "config", *argv], cwd=ROOT,
                    env=env, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
        # The runner loads the model's tokenizer once it is ready (batches.runner.runner_warm): the
        # phases start after it, so that the load takes nothing from the capacity measured.
        deadline = time.monotonic() + 300
        while "batch runner warm:" not in stack.log_path("celery-batches").read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise RuntimeError("the batch runner did not warm up within 300 s")
            time.sleep(0.5)
        rng = random.Random(0)
        source = PromptSource(model_dir, rng, real_text=args.model == "smollm2")
        prompts = [source.take(args.prompt_tokens) for _ in range(64)]
        interactive = openai.OpenAI(
            base_url=stack.api_base, api_key=interactive_key, max_retries=0, timeout=600
        )
        batcher = openai.OpenAI(base_url=stack.api_base, api_key=stack.api_key, max_retries=0, timeout=600)

        # Warm-up: the first requests of a fresh engine pay for its first step shapes.
        for prompt in prompts[:4]:
            interactive.completions.create(**_sdk_kwargs(_body(stack.model, prompt, args.max_tokens)))

        def phase(
            key: str, what: str, *, saturate: bool = False, until=None
        ) -> tuple[list[float], list[dict[str, float]]]:
            """Run a phase (the engine saturated, or the interactive load until `until` returns,
            by default for --duration-s), log it and keep its figures under `key`; its TTFTs and
            their parts."""
            log(f"{key}: {what}")
            figures[key], ttfts, parts = _phase(
                interactive, stack.model, prompts, args,
                clients=args.saturate if saturate else args.clients,
                think_s=0.0 if saturate else args.think_s,
                until=until or (lambda: time.sleep(args.duration_s)),
            )  # fmt: skip
            log(f"{key}: {figures[key]}")
            return ttfts, parts

        phase("capacity_before", "the engine saturated", saturate=True)
        alone_ttfts, alone_parts = phase("alone_before", "the interactive load")

        lines = [
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": _body(stack.model, prompts[i % len(prompts)], args.max_tokens),
                }  # fmt: skip
            )
            for i in range(args.requests)
        ]
        upload = io.BytesIO(("\n".join(lines) + "\n").encode())
        file_id = batcher.files.create(file=("batch.jsonl", upload), purpose="batch").id
        batch_info: dict[str, Any] = {}

        def until_batch_done() -> None:
            batch = batcher.batches.create(
                input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
            )
            started = time.perf_counter()
            last = -1
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(1.0)
                batch = batcher.batches.retrieve(batch.id)
                if batch.request_counts.completed // 100 != last // 100:
                    last = batch.request_counts.completed
                    log(f"batch: {batch.status}, {last} / {batch.request_counts.total}")
            batch_info.update(batch=batch, seconds=time.perf_counter() - started)

        phase("with_batch", "the interactive load beside the batch", until=until_batch_done)
        ttfts, parts = phase("alone_after", "the interactive load alone once more")
        alone_ttfts, alone_parts = alone_ttfts + ttfts, alone_parts + parts
        phase("capacity_after", "the engine saturated once more", saturate=True)
        figures["alone"] = _both_sides(
            figures["alone_before"], figures["alone_after"], alone_ttfts, alone_parts
        )
        figures["capacity"] = {
            "output_tok_s": round(
                (figures["capacity_before"]["output_tok_s"] + figures["capacity_after"]["output_tok_s"]) / 2,
                1,
            )
        }
        batch = batch_info["batch"]
        from tenants.models import UsageRecord

        rows = UsageRecord.objects.filter(batch_id=batch.id, status="success")
        batch_tokens = sum(r.completion_tokens for r in rows)
        seconds = batch_info["seconds"]
        figures["batch"] = {
            "status": batch.status,
            "completed": batch.request_counts.completed,
            "failed": batch.request_counts.failed,
            "seconds": round(seconds, 1),
            "output_tok_s": round(batch_tokens / seconds, 1),
            "price_factor": str(rows.first().price_factor) if rows else None,
        }
        spare = figures["capacity"]["output_tok_s"] - figures["with_batch"]["output_tok_s"]
        figures["batch_share_of_spare"] = (
            round(figures["batch"]["output_tok_s"] / spare, 3) if spare > 0 else None
        )
        from inference.selectors import deployment_replicas

        # What the replica measured and did: the shared step width's fixed cost (in decode rows,
        # from its start-up probe), and the batch's steps it gave up for interactive arrivals.
        costs = re.search(
            r"step costs: .*?\(([0-9.]+) rows\)", stack.log_path("engine").read_text(errors="replace")
        )
        figures["step_fixed_rows"] = float(costs.group(1)) if costs else None
        figures["interrupted_steps"] = sum(
            r.num_interrupted_steps for r in deployment_replicas(name=stack.model)
        )
        # CPU seconds each process used over the whole run (the runner shares the cores).
        used = cpu_seconds({name: -proc.pid for name, proc in stack.processes.items()})
        figures["cpu_s"] = {name: round(seconds, 1) for name, seconds in used.items()}
        figures["p90_ttft_ratio"] = round(
            figures["with_batch"]["p90_ttft_ms"] / figures["alone"]["p90_ttft_ms"], 3
        )
        log(json.dumps(figures, indent=1))
    except BaseException:
        log(f"failed; the stack's logs are in {stack.keep_logs()}")
        raise
    finally:
        stack.stop()
        from batches.models import Batch, File
        from tenants.models import Tenant, UsageDaily, UsageRecord

        # What this run wrote beyond the stack's own rows: batches hold their key, files their bytes,
        # and the ledger (its records and the beat's daily roll-ups) the interactive tenant's key.
        # A failure here is printed; the figures are printed anyway.
        try:
            for tenant_id in (stack.tenant_id, other.pk):
                Batch.objects.filter(tenant_id=tenant_id).delete()
                for file in File.objects.filter(tenant_id=tenant_id):
                    file.content.delete(save=False)
                    file.delete()
            UsageRecord.objects.filter(tenant_id=other.pk).delete()
            UsageDaily.objects.filter(tenant_id=other.pk).delete()
            Tenant.objects.filter(pk=other.pk).delete()
        except Exception as exc:  # noqa: BLE001 - reported; the run's figures still count
            log(f"could not remove this run's rows: {exc!r}")
        stack.close()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
