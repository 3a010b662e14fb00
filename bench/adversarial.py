"""Adversarial cost: a victim tenant's streams beside cheap-to-send, costly-to-serve requests.

The whole stack runs (daphne and one engine replica as subprocesses, bench._stack) on
SmolLM2-135M-Instruct in float32 on CPU, with two tenants: the victim, unthrottled, and the attacker,
unthrottled in tokens, concurrency and quota (what the engine is made to pay is measured) but held
to a new tenant's requests per minute (600 by default; --attacker-rpm, 0 for none), the bound on
floods of cheap requests, whose 429s are held (PAGODA_RATE_LIMIT_HOLD_S). The victim keeps
--victim-streams chat streams going, one request after another: a short question, --victim-tokens tokens with EOS ignored, every other
request under a JSON schema of its own (a new schema each time, so each needs a grammar compile).

Phases, each --phase-s seconds, in this order:
  baseline        the victim alone.
  regex           the attacker keeps --attackers requests going with structured_outputs
                  {"regex": ".{0,4000}"} and n 32 (a mask that is costly to fill at every step).
  echo_logprobs   /v1/completions with echo, logprobs 20, prompt_logprobs 20, max_tokens 0 and n 64
                  on a ~1,000-token prompt (the prompt's logprobs built per choice).
  slow_regexes    24 distinct regexes that each take seconds to compile, each sent with `timeout`
                  0.001, again and again (new ones each time): the compiler jammed for free.
  bias_penalties  logit_bias with 1,000 entries, presence/frequency/repetition penalties, a
                  ~1,000-token prompt, n 64 and 256 tokens.
  wide_n          n 128 with 2,000 tokens, EOS ignored (where the platform caps n lower, as many
                  requests at the cap as make up 128 sequences).
  baseline_again  the victim alone once more: the machine's drift over the run.
Each attack but wide_n runs right after its plain twin (plain_<attack>): the same requests without
what makes them costly (no regex, no logprobs, no bias or penalties), the load its sender pays for.
An attack's requests still running when its phase ends are cut (the client disconnects, the
engine aborts them) before the next phase starts.

Figures: per phase, the victim's TTFT p90 (requests that started in the phase) and inter-token
latency p50 (gaps between streamed chunks that arrived in it), their ratios to the baseline (the
mean of the two baseline phases), the same over the plain twin (`*_vs_plain`: what the costly part
adds), and the attacker's answers by status. Target: every ratio to the baseline <= 2.0. On a CPU
the step time grows with the batch, so a paid-for load of many sequences would slow the victim by
itself; the replica keeps a shared step within `shared_step_slowdown` of the victim's own (engine
setting, 1.5: `--engine-setting shared_step_slowdown=0` shows the load without the bound), and
`--max-num-seqs` sizes the replica's batch (and so the cap on `n`, a quarter of it).
The final line is JSON.

    OMP_NUM_THREADS=2 .venv/bin/python bench/adversarial.py                 # ~8 minutes
    OMP_NUM_THREADS=2 .venv/bin/python bench/adversarial.py --phase-s 20    # quicker, noisier
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._stack import (  # noqa: E402
    UNTHROTTLED,
    BenchStack,
    add_engine_setting_option,
    create_stack,
    engine_settings_from,
)
from bench.common import percentile  # noqa: E402

TARGET = 2.0
QUESTIONS = [
    "What is a pagoda?",
    "Name three rivers in Europe.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
]
ATTACKS = ("regex", "echo_logprobs", "slow_regexes", "bias_penalties", "wide_n")


@dataclass
class Phase:
    """What the victim saw while this phase was current: the time to first token of each request
    that started in it, and every gap between two streamed chunks that arrived in it (a request
    may straddle two phases: each of its gaps counts where it fell)."""

    name: str
    # (time to first token, whether the request had a JSON schema) of each request started in it
    firsts: list[tuple[float, bool]] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    victim_errors: Counter = field(default_factory=Counter)
    attacker: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def attacker_saw(self, outcome: str) -> None:
        with self.lock:
            self.attacker[outcome] += 1

    def figures(self) -> dict[str, Any]:
        ttfts_s = [t for t, _ in self.firsts]
        return {
            "victim_requests": len(ttfts_s),
            "victim_chunks": len(self.gaps_s),
            "victim_errors": dict(self.victim_errors),
            "ttft_p90_ms": round(1000 * percentile(ttfts_s, 90), 1) if ttfts_s else None,
            "itl_p50_ms": round(1000 * percentile(self.gaps_s, 50), 1) if self.gaps_s else None,
            # The three slowest first tokens, each marked s (a JSON schema) or p (plain text).
            "slowest_ttft_ms": [
                f"{1000 * t:.0f}{'s' if schema else 'p'}"
                for t, schema in sorted(self.firsts, reverse=True)[:3]
            ],
            "attacker": dict(self.attacker),
        }


def victim_schema(i: int) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": f"answer_{i}",
            "schema": {
                "type": "object",
                "properties": {f"answer_{i}": {"type": "string"}, "score": {"type": "integer"}},
                "required": [f"answer_{i}", "score"],
            },
        },
    }


_counter_lock = threading.Lock()


def victim_loop(client, model: str, phase_of, stop: threading.Event, counter: list[int], tokens: int) -> None:
    while not stop.is_set():
        with _counter_lock:
            counter[0] += 1
            i = counter[0]
        kwargs: dict[str, Any] = {}
        if i % 2 == 0:
            kwargs["response_format"] = victim_schema(i)
        started_in = phase_of()
        started = time.perf_counter()
        last = None
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                max_tokens=tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
                **kwargs,
            )
            for chunk in stream:
                if not chunk.choices or not chunk.choices[0].delta.content:
                    continue
                now = time.perf_counter()
                if last is None:
                    started_in.firsts.append((now - started, "response_format" in kwargs))
                else:
                    phase_of().gaps_s.append(now - last)
                last = now
        except Exception as exc:  # noqa: BLE001 - every failure is a figure
            started_in.victim_errors[type(exc).__name__] += 1


def slow_regex(i: int) -> str:
    # Each compiles in ~2 s for SmolLM2's vocabulary on this machine's cores (a distinct bound, so
    # no cache helps), and its mask is cheap: what it costs is the compiler's time.
    return "[a-zA-Z0-9 ]{0," + str(1500 + i) + "}z{0,1000}"


def long_prompt(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words = "river stone pagoda lantern garden bridge mountain temple cloud bamboo".split()
    return " ".join(rng.choice(words) for _ in range(tokens))


# The sequences each attack asks for per request (the figures).
WANTED_N = {"regex": 32, "echo_logprobs": 64, "slow_regexes": 1, "bias_penalties": 64, "wide_n": 128}


class Attacker:
    def __init__(self, raw, model: str, phase: Phase, sequence_cap: list[int], until: float | None = None):
        self.raw = raw  # httpx client for the fields the SDK does not type
        self.model = model
        self.phase = phase
        self.sequence_cap = sequence_cap
        # The phase's end (time.monotonic()): a request still unanswered then is cut (its read times
        # out, the client disconnects, the engine aborts it), so that it does not run on into the
        # next phase.
        self.until = until

    def timeout(self) -> float | None:
        return None if self.until is None else max(0.1, self.until - time.monotonic())

    def post(self, path: str, body: dict[str, Any], *, stream: bool = False) -> None:
        try:
            if stream:
                with self.raw.stream("POST", path, json=body, timeout=self.timeout()) as response:
                    for _ in response.iter_bytes():
                        if self.until is not None and time.monotonic() > self.until:
                            raise TimeoutError("the phase ended")
                    self.phase.attacker_saw(str(response.status_code))
                    if response.status_code == 400:
                        self.learn_cap(response.read(), body)
                return
            response = self.raw.post(path, json=body, timeout=self.timeout())
            self.phase.attacker_saw(str(response.status_code))
            if response.status_code == 400:
                self.learn_cap(response.content, body)
        except Exception as exc:  # noqa: BLE001
            self.phase.attacker_saw(type(exc).__name__)

    def learn_cap(self, content: bytes, body: dict[str, Any]) -> None:
        """A refused `n`: the attacker sends more requests at the largest `n` that passes instead."""
        with contextlib.suppress(ValueError, KeyError, TypeError):
            error = json.loads(content)["error"]
            if error.get("param") == "n" and body.get("n", 1) > 1:
                self.sequence_cap[0] = min(self.sequence_cap[0], max(1, body["n"] // 2))

    def chat(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": "Write."}], **fields}

    def run(self, kind: str, worker: int, stop: threading.Event, plain: bool = False) -> None:
        """Send `kind`'s requests until `stop`; `plain`: the same requests without what makes them
        costly (the regex, the logprobs, the bias and penalties): the load its sender pays for."""
        i = 0
        n = min(WANTED_N[kind], self.sequence_cap[0])
        while not stop.is_set():
            i += 1
            if kind == "regex":
                body = self.chat(n=n, max_tokens=128, ignore_eos=True)
                if not plain:
                    body["structured_outputs"] = {"regex": ".{0,4000}"}
                self.post("/chat/completions", body)
            elif kind == "echo_logprobs":
                body = {
                    "model": self.model,
                    # A new prompt each time: prompt logprobs are never served from the prefix
                    # cache, so the plain twin must not be either.
                    "prompt": long_prompt(1000, seed=worker * 100_003 + i),
                    "echo": True,
                    "max_tokens": 0,
                    "n": n,
                }
                if not plain:
                    body.update(logprobs=20, prompt_logprobs=20)
                self.post("/completions", body)
            elif kind == "slow_regexes":
                n = 24 * 1000 * worker + i
                body = self.chat(max_tokens=8, timeout=0.001)
                if not plain:
                    body["structured_outputs"] = {"regex": slow_regex(n)}
                self.post("/chat/completions", body)
            elif kind == "bias_penalties":
                rng = random.Random(worker * 7919 + i)
                bias = {str(t): rng.choice([-5, -1, 1, 5]) for t in rng.sample(range(100, 49000), 1000)}
                body = {
                    "model": self.model,
                    "prompt": long_prompt(1000, seed=worker * 13 + i),
                    "n": n,
                    "max_tokens": 256,
                    "ignore_eos": True,
                }
                if not plain:
                    body.update(
                        logit_bias=bias, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2
                    )
                self.post("/completions", body)
            elif kind == "wide_n":
                body = self.chat(n=n, max_tokens=2000, ignore_eos=True, stream=True)
                self.post("/chat/completions", body, stream=True)


def attack_workers(kind: str, attackers: int, sequence_cap: int) -> int:
    """Concurrent attack requests: where the platform caps `n` below what the attack wants, as
    many more requests as make up the sequences it wanted."""
    if kind == "slow_regexes":
        return 24
    per_request = min(WANTED_N[kind], sequence_cap)
    wanted = WANTED_N[kind] * (1 if kind == "wide_n" else attackers)
    return max(1, -(-wanted // per_request))


def add_attacker_tenant(stack: BenchStack, *, requests_per_minute: int | None) -> tuple[int, str]:
    """The attacker's tenant: unthrottled in tokens, concurrency and quota (what the engine is made to
    pay is measured), at `requests_per_minute` (None: unthrottled too)."""
    from tenants.services import api_key_create, tenant_create

    limits = dict(UNTHROTTLED)
    if requests_per_minute is not None:
        limits["requests_per_minute"] = requests_per_minute
    tenant = tenant_create(
        name=f"Attacker {stack.run_id}",
        slug=f"attacker-{stack.run_id}",
        allowed_models=[stack.model],
        **limits,
    )
    _, raw_key = api_key_create(tenant=tenant, name="attacker")
    return tenant.pk, raw_key


def remove_tenant(tenant_id: int) -> None:
    from tenants.models import Tenant, UsageDaily, UsageRecord

    for rows in (
        UsageRecord.objects.filter(tenant_id=tenant_id),
        UsageDaily.objects.filter(tenant_id=tenant_id),
        Tenant.objects.filter(pk=tenant_id),
    ):
        with contextlib.suppress(Exception):
            rows.delete()


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return round(value / base, 2)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--victim-streams", type=int, default=2)
    parser.add_argument("--victim-tokens", type=int, default=32)
    parser.add_argument("--attackers", type=int, default=2, help="concurrent attack requests")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument(
        "--attacker-rpm",
        type=int,
        default=None,
        help="the attacker tenant's requests per minute (default: a new tenant's, "
        "PAGODA_TENANT_DEFAULT_RPM; 0: unthrottled)",
    )
    add_engine_setting_option(parser, help="a deployment engine_settings entry (JSON value), repeatable")
    args = parser.parse_args()
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        parser.error(f"unknown attacks: {sorted(unknown)}")

    import httpx
    import openai

    from engine.demo_model import default_model_dir, fetch_demo_model

    model_dir = fetch_demo_model(default_model_dir("float32"), dtype="float32", progress=False)
    engine_settings = engine_settings_from(args.engine_setting, {"max_num_seqs": args.max_num_seqs})
    stack = create_stack(model_dir=model_dir, engine_settings=engine_settings, max_model_len=4096)
    attacker_tenant = None
    try:
        from django.conf import settings

        attacker_rpm = args.attacker_rpm
        if attacker_rpm is None:
            attacker_rpm = int(settings.TENANT_DEFAULT_LIMITS["requests_per_minute"])
        attacker_tenant, attacker_key = add_attacker_tenant(stack, requests_per_minute=attacker_rpm or None)
        stack.start(threads=args.threads)
        victim = openai.OpenAI(base_url=stack.api_base, api_key=stack.api_key, max_retries=0, timeout=600)
        raw = httpx.Client(
            base_url=stack.api_base, headers={"Authorization": f"Bearer {attacker_key}"}, timeout=600
        )
        # Warm-up: the first requests build the tokenizer, the chat template and the JSON grammars.
        for i in range(3):
            victim.chat.completions.create(
                model=stack.model,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                **({"response_format": victim_schema(-1 - i)} if i else {}),
            )

        # Each attack but wide_n (whose shape is the attack) follows its plain twin.
        phases = ["baseline"]
        for name in attacks:
            phases += [name] if name == "wide_n" else [f"plain_{name}", name]
        phases.append("baseline_again")
        results: dict[str, Phase] = {}
        current: list[Phase] = [Phase("warmup")]
        counter = [0]
        sequence_cap = [128]
        # The largest `n` the platform takes (a refused `n` halves it until one passes).
        probe = Attacker(raw, stack.model, Phase("probe"), sequence_cap)
        while sequence_cap[0] > 1:
            tried = sequence_cap[0]
            probe.post("/chat/completions", probe.chat(n=tried, max_tokens=1))
            if sequence_cap[0] == tried:
                break
        stop_victim = threading.Event()
        victims = [
            threading.Thread(
                target=victim_loop,
                args=(victim, stack.model, lambda: current[0], stop_victim, counter, args.victim_tokens),
                daemon=True,
            )
            for _ in range(args.victim_streams)
        ]
        for thread in victims:
            thread.start()
        for name in phases:
            phase = Phase(name)
            results[name] = phase
            stop_attack = threading.Event()
            workers: list[threading.Thread] = []
            kind = name.removeprefix("plain_")
            if kind in ATTACKS:
                attacker = Attacker(
                    raw, stack.model, phase, sequence_cap, until=time.monotonic() + args.phase_s
                )
                for w in range(attack_workers(kind, args.attackers, sequence_cap[0])):
                    workers.append(
                        threading.Thread(
                            target=attacker.run, args=(kind, w, stop_attack, name != kind), daemon=True
                        )
                    )
                for thread in workers:
                    thread.start()
            current[0] = phase
            print(f"[adversarial] {name} for {args.phase_s:.0f}s", file=sys.stderr, flush=True)
            time.sleep(args.phase_s)
            current[0] = Phase("between")
            stop_attack.set()
            # The attack's requests still in flight finish or are cut before the next phase starts.
            for thread in workers:
                thread.join(timeout=5)
            raw.close()
            raw = httpx.Client(
                base_url=stack.api_base, headers={"Authorization": f"Bearer {attacker_key}"}, timeout=600
            )
            drain_until = time.monotonic() + 120
            while time.monotonic() < drain_until and any(t.is_alive() for t in workers):
                time.sleep(0.5)
            print(f"[adversarial] {name}: {json.dumps(phase.figures(), default=dict)}", file=sys.stderr)
        stop_victim.set()
        for thread in victims:
            thread.join(timeout=120)

        base = {name: results[name].figures() for name in ("baseline", "baseline_again")}

        def mean_of(key: str) -> float | None:
            values = [f[key] for f in base.values() if f[key] is not None]
            return sum(values) / len(values) if values else None

        base_ttft, base_itl = mean_of("ttft_p90_ms"), mean_of("itl_p50_ms")
        figures: dict[str, Any] = {"baseline": base, "attacks": {}}
        worst = 0.0
        for name in attacks:
            f = results[name].figures()
            f["ttft_p90_ratio"] = ratio(f["ttft_p90_ms"], base_ttft)
            f["itl_p50_ratio"] = ratio(f["itl_p50_ms"], base_itl)
            for key in ("ttft_p90_ratio", "itl_p50_ratio"):
                worst = max(worst, f[key] if f[key] is not None else float("inf"))
            if f"plain_{name}" in results:
                # What the costly part adds over the same load without it.
                plain = results[f"plain_{name}"].figures()
                f["plain"] = plain
                f["ttft_p90_vs_plain"] = ratio(f["ttft_p90_ms"], plain["ttft_p90_ms"])
                f["itl_p50_vs_plain"] = ratio(f["itl_p50_ms"], plain["itl_p50_ms"])
            figures["attacks"][name] = f
        figures.update(
            target=TARGET,
            worst_ratio=worst,
            within_target=worst <= TARGET,
            machine=f"{cpu_name()}, {os.cpu_count()} cores",
            model="SmolLM2-135M-Instruct float32",
            engine_settings=engine_settings,
            phase_s=args.phase_s,
            victim_streams=args.victim_streams,
            sequence_cap_seen=sequence_cap[0],
            attacker_requests_per_minute=attacker_rpm or None,
        )
        print(json.dumps(figures, default=dict), flush=True)
        return 0 if figures["within_target"] else 1
    finally:
        if attacker_tenant is not None:
            stack.stop()
            remove_tenant(attacker_tenant)
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
