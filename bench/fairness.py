r"""Fair share across tenants on the real engine: service rates, TTFT and priority tiers, against FCFS.

In-process, on the real `LLMEngine` with the ~32M-parameter random-weight `bench` model in float32
on CPU (a step takes ~20 ms of decodes to ~250 ms with a full prefill chunk; a 10 s window of the
fair run holds ~60 finished requests: meaningful windows, no need for the `small` model). On a
shared machine other load moves every figure: each run reports the CPU the rest of the machine
used meanwhile (other_cpu_per_wall, per run and per window); trust a run where it is near 0.

Simulated closed-loop clients live in the one Python loop that steps the engine: a tenant keeps K
requests outstanding and, when one finishes, submits its next one at once, before the next
engine.step(). Each tenant
draws its requests from its own seeded RNG (seeded by --seed and the tenant's name, so light sends
the same requests in every run): prompts of uniform 32-256 random token ids from a range of the
vocabulary that no other tenant uses (no cross-tenant prefix-cache hits), outputs of uniform 16-128
tokens, greedy, EOS ignored. The engine: max_num_seqs 15, max_num_batched_tokens 512 (chunked
prefill), 512 KV blocks of 16 tokens (room for every running sequence: nothing is preempted for
blocks), prefix caching on.

Service is what the scheduler's virtual token counters count: 2 x output tokens + prompt tokens
computed (a request's prompt tokens less its num_cached_tokens, counted when its first output
token arrives). It is summed per tenant per window (--window-s, 10 s) and divided by the window's
length; the first window of each run is warm-up and is left out of every figure. Time to first
token runs from add_request to the end of the step that returns the first output token. Runs, one
after the other, each on a fresh engine (each --duration-s, 60 s, except solo and priority_idle,
--short-duration-s, 30 s):

  fair           "heavy" keeps 21 requests outstanding, "light" 7 (3x), policy fair. 28 requests
                 for 15 sequence slots: both always have work in the engine and heavy always has
                 some waiting. Light's 7 are just under half the slots, so light asks for a little
                 less than its fair share (47-49% of the service) and heavy for far more. With
                 light at exactly half the slots (--max-num-seqs 8 --heavy-k 12 --light-k 4) its
                 counter catches up with heavy's now and then, and a request it sends then waits
                 for a heavy sequence to finish: see bench/RESULTS.md for that variant.
  fcfs           the same clients, policy fcfs (the baseline).
  solo           light alone (K=7) on the same engine: its TTFT without a competitor.
  weighted       four tenants with weights 1, 2, 3, 4 (weight=), 10 outstanding each (40 for 15
                 slots: all stay backlogged), policy fair.
  priority       a default-tier load (priority=1, tenant "bulk", 24 outstanding) plus a
                 priority-tier client (priority=0, tenant "vip") that sends one request at a time
                 and waits --vip-pause-s (0.5 s) after each finishes before sending the next; its
                 outputs are 16-32 tokens (prompts 32-256) to get more TTFT samples. Policy fair.
  priority_idle  the same vip client, sending the same requests, on an otherwise idle engine.

Figures (the final JSON line): jain_min, Jain's index (x1+x2)^2 / (2(x1^2+x2^2)) of heavy's and
light's service rates in the fair run, worst window; service_gap_vs_fcfs, the mean over windows of
|heavy - light| service rate, fair over fcfs; light_p90_ttft_vs_fcfs and light_p90_ttft_vs_solo,
light's p90 TTFT in the fair run over fcfs and over solo; throughput_vs_fcfs, total output tokens/s
fair over fcfs (tokens_per_step_vs_fcfs: the same per engine step, which other load on a shared
machine does not move); weighted_share_max_error, the largest |tenant's share of the service - its
weight / sum of weights| over the whole weighted run (and _worst_window, over single windows);
priority_p90_ttft_vs_idle, the vip client's p90 TTFT under load over idle. Each with its target
and a boolean, and every run's raw figures, with the machine's load average before and after it
and the CPU other processes used during it.
Progress, one line per window, goes to stderr.

    OMP_NUM_THREADS=2 .venv/bin/python bench/fairness.py             # ~5 minutes
    OMP_NUM_THREADS=2 .venv/bin/python bench/fairness.py --quick     # smoke run, <1 min, noisy figures
    # light at exactly its share of the slots:
    OMP_NUM_THREADS=2 .venv/bin/python bench/fairness.py --runs fair,fcfs,solo \
        --max-num-seqs 8 --heavy-k 12 --light-k 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import bench_model_dir, log, num_parameters, percentile, vocab_size  # noqa: E402

TARGETS = {
    "jain_min": (">=", 0.98),
    "service_gap_vs_fcfs": ("<=", 0.3),
    "light_p90_ttft_vs_fcfs": ("<=", 0.3),
    "light_p90_ttft_vs_solo": ("<=", 2.0),
    "throughput_vs_fcfs": (">=", 0.95),
    "weighted_share_max_error": ("<=", 0.05),
    "priority_p90_ttft_vs_idle": ("<=", 2.0),
}
FIRST_TOKEN_ID = 6  # ids 0-5 are the made-up models' special tokens


@dataclass
class Client:
    """A closed-loop client of one tenant: keeps `k` requests outstanding; after one finishes it
    sends the next at once, or `pause_s` later."""

    tenant: str
    k: int
    seed: int
    id_range: tuple[int, int]  # prompt token ids [lo, hi): this tenant's own part of the vocabulary
    priority: int = 1
    weight: float = 1.0
    pause_s: float = 0.0
    output_range: tuple[int, int] = (16, 128)
    prompt_range: tuple[int, int] = (32, 256)
    rng: random.Random = field(init=False)
    outstanding: int = 0
    sent: int = 0
    due: list[float] = field(default_factory=list)  # when each free slot may send again

    def __post_init__(self) -> None:
        # Seeded by tenant, not by run: fair, fcfs and solo send light the same requests.
        self.rng = random.Random(f"{self.seed}:{self.tenant}")

    def next_request(self) -> tuple[list[int], int]:
        lo, hi = self.id_range
        prompt = [self.rng.randrange(lo, hi) for _ in range(self.rng.randint(*self.prompt_range))]
        return prompt, self.rng.randint(*self.output_range)


@dataclass
class Pending:
    client: Client
    submitted: float
    num_prompt_tokens: int
    first_token: bool = False


@dataclass
class RunResult:
    name: str
    policy: str
    windows: list[dict]  # per window: start, length, per-tenant service / output tokens
    ttft: dict[str, list[float]]  # seconds, requests whose first token came after the warm-up
    preemptions: int
    steps: int
    measured_steps: int  # steps after the warm-up window
    loadavg: tuple[float, float]  # 1-minute load average before and after (this process adds ~2)
    cpu_per_wall: float  # this process's CPU seconds per wall second (2 threads: ~2 when unloaded)
    other_cpu_per_wall: float | None  # CPU seconds per wall second the rest of the machine used


def make_engine(model_dir: Path, args: argparse.Namespace, policy: str):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            seed=args.seed,
            cache=CacheConfig(num_blocks=args.num_blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=1024,
                policy=policy,
            ),
        )
    )


def run(name: str, policy: str, clients: list[Client], duration_s: float, model_dir: Path, args) -> RunResult:
    from engine.sampling_params import SamplingParams

    engine = make_engine(model_dir, args, policy)
    window_s = args.window_s
    num_windows = max(2, round(duration_s / window_s))
    tenants = [c.tenant for c in clients]
    windows = [
        {
            "service": dict.fromkeys(tenants, 0),
            "output": dict.fromkeys(tenants, 0),
            "prompt": dict.fromkeys(tenants, 0),
        }
        for _ in range(num_windows)
    ]
    ttft: dict[str, list[float]] = {t: [] for t in tenants}
    pending: dict[str, Pending] = {}
    log(
        f"[{name}] policy {policy}, {num_windows} windows of {window_s:g}s: "
        + ", ".join(f"{c.tenant} K={c.k} prio={c.priority} w={c.weight:g}" for c in clients)
    )

    load_before = os.getloadavg()[0]
    busy0 = machine_busy_s()
    cpu0 = time.process_time()
    start = time.perf_counter()
    end = start + num_windows * window_s
    measured_steps = 0
    for c in clients:
        c.outstanding, c.sent, c.due = 0, 0, [start] * c.k
    reported = 0
    mark = [busy0, cpu0, start]  # machine busy, own CPU and wall seconds when the last window closed
    last = start
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        # Send what is due: closed loop, so a finished request's successor goes in before the step.
        for c in clients:
            while c.due and c.due[0] <= now:
                c.due.pop(0)
                prompt, max_tokens = c.next_request()
                rid = f"{name}-{c.tenant}-{c.sent}"
                c.sent += 1
                c.outstanding += 1
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                submitted = time.perf_counter()
                engine.add_request(rid, prompt, params, tenant=c.tenant, priority=c.priority, weight=c.weight)
                pending[rid] = Pending(c, submitted, len(prompt))
        if not engine.has_unfinished_requests():
            wake = min((d for c in clients for d in c.due), default=end)
            time.sleep(max(0.0, min(wake, end) - time.perf_counter()))
            continue
        outputs = engine.step()
        now = last = time.perf_counter()
        w = min(int((now - start) // window_s), num_windows - 1)
        measured_steps += w > 0
        win = windows[w]
        for out in outputs:
            p = pending[out.request_id]
            tenant = p.client.tenant
            n_out = len(out.outputs[0].token_ids_delta)
            win["output"][tenant] += n_out
            win["service"][tenant] += 2 * n_out
            if n_out and not p.first_token:
                p.first_token = True
                computed = p.num_prompt_tokens - out.num_cached_tokens
                win["prompt"][tenant] += computed
                win["service"][tenant] += computed
                if w > 0:
                    ttft[tenant].append(now - p.submitted)
            if out.finished:
                assert out.error is None, out.error
                del pending[out.request_id]
                p.client.outstanding -= 1
                p.client.due.append(now + p.client.pause_s)
        while reported < w:  # a window closed: report it
            _log_window(name, reported, windows[reported], window_s, engine, mark)
            reported += 1
    own_cpu = time.process_time() - cpu0
    busy1 = machine_busy_s()
    cpu_per_wall = own_cpu / (last - start)
    other = None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - own_cpu) / (last - start)
    for i, win in enumerate(windows):
        win["start"] = i * window_s
        win["length"] = window_s if i < num_windows - 1 else max(last - start - i * window_s, 1e-9)
    while reported < num_windows:
        _log_window(name, reported, windows[reported], windows[reported]["length"], engine, mark)
        reported += 1
    return RunResult(
        name,
        policy,
        windows,
        ttft,
        engine.scheduler.num_preemptions,
        engine.num_steps,
        measured_steps,
        (load_before, os.getloadavg()[0]),
        cpu_per_wall,
        other,
    )


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy (Linux /proc/stat), to tell other load apart."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _log_window(name: str, i: int, win: dict, length: float, engine, mark: list) -> None:
    rates = ", ".join(f"{t} {s / length:.0f}" for t, s in win["service"].items())
    tok = sum(win["output"].values()) / length
    stats = engine.get_stats()
    busy, cpu, now = machine_busy_s(), time.process_time(), time.perf_counter()
    other = None if busy is None or mark[0] is None else max(0.0, busy - mark[0] - (cpu - mark[1]))
    win["other_cpu_per_wall"] = None if other is None else round(other / (now - mark[2]), 2)
    mark[:] = [busy, cpu, now]
    log(
        f"[{name}] window {i}{' (warm-up)' if i == 0 else ''}: service/s {rates}; "
        f"output {tok:.0f} tok/s; running {stats['num_running']}, waiting {stats['num_waiting']}; "
        f"other processes' CPU/wall {win['other_cpu_per_wall']}"
    )


# -- figures --------------------------------------------------------------------------------------


def measured(r: RunResult) -> list[dict]:
    return r.windows[1:]


def rate(r: RunResult, key: str, tenant: str) -> float:
    wins = measured(r)
    return sum(w[key][tenant] for w in wins) / sum(w["length"] for w in wins)


def window_rates(r: RunResult, tenant: str) -> list[float]:
    return [w["service"][tenant] / w["length"] for w in measured(r)]


def output_tok_s(r: RunResult) -> float:
    wins = measured(r)
    return sum(sum(w["output"].values()) for w in wins) / sum(w["length"] for w in wins)


def ttft_stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": round(1000 * percentile(values, 50), 1),
        "p90_ms": round(1000 * percentile(values, 90), 1),
        "p99_ms": round(1000 * percentile(values, 99), 1),
    }


def summary(r: RunResult) -> dict:
    tenants = list(r.ttft)
    return {
        "policy": r.policy,
        "service_per_s": {t: round(rate(r, "service", t), 1) for t in tenants},
        "service_per_s_by_window": {t: [round(x, 1) for x in window_rates(r, t)] for t in tenants},
        "output_tok_s": round(output_tok_s(r), 1),
        # Independent of the machine's speed: how full the batches were.
        "output_tokens_per_step": round(
            sum(sum(w["output"].values()) for w in measured(r)) / max(r.measured_steps, 1), 2
        ),
        "output_tok_s_by_tenant": {t: round(rate(r, "output", t), 1) for t in tenants},
        "ttft": {t: ttft_stats(v) for t, v in r.ttft.items()},
        "preemptions": r.preemptions,
        "steps": r.steps,
        "loadavg_before_after": [round(x, 2) for x in r.loadavg],
        "cpu_per_wall": round(r.cpu_per_wall, 2),
        "other_cpu_per_wall": None if r.other_cpu_per_wall is None else round(r.other_cpu_per_wall, 2),
        "other_cpu_per_wall_by_window": [w.get("other_cpu_per_wall") for w in r.windows],
    }


def jain(x1: float, x2: float) -> float:
    return (x1 + x2) ** 2 / (2 * (x1 * x1 + x2 * x2)) if x1 or x2 else 1.0


def mean_gap(r: RunResult) -> float:
    gaps = [abs(h - li) for h, li in zip(window_rates(r, "heavy"), window_rates(r, "light"), strict=True)]
    return sum(gaps) / len(gaps)


def p90(values: list[float]) -> float:
    return percentile(values, 90) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=60.0, help="each run's length")
    parser.add_argument("--short-duration-s", type=float, default=30.0, help="solo and priority_idle")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 3 s windows, 9 s runs; figures too noisy to judge"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--size", default="bench", help="engine.make_model size of the built model")
    parser.add_argument("--max-num-seqs", type=int, default=15)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--heavy-k", type=int, default=21)
    parser.add_argument("--light-k", type=int, default=7)
    parser.add_argument("--weighted-k", type=int, default=10)
    parser.add_argument("--bulk-k", type=int, default=24, help="default-tier load of the priority run")
    parser.add_argument("--vip-pause-s", type=float, default=0.5)
    parser.add_argument(
        "--runs", default="fair,fcfs,solo,weighted,priority,priority_idle", help="a subset, for trials"
    )
    args = parser.parse_args()
    if args.quick:
        args.window_s, args.duration_s, args.short_duration_s = 3.0, 9.0, 6.0
    torch.set_num_threads(args.threads)
    model_dir = bench_model_dir(size=args.size)
    vocab = vocab_size(model_dir)
    names = ["heavy", "light", "w1", "w2", "w3", "w4", "bulk", "vip"]
    span = (vocab - FIRST_TOKEN_ID) // len(names)
    ranges = {n: (FIRST_TOKEN_ID + i * span, FIRST_TOKEN_ID + (i + 1) * span) for i, n in enumerate(names)}

    def client(tenant: str, k: int, **kw) -> Client:
        return Client(tenant, k, args.seed, ranges[tenant], **kw)

    plans = {
        "fair": (
            "fair",
            lambda: [client("heavy", args.heavy_k), client("light", args.light_k)],
            args.duration_s,
        ),
        "fcfs": (
            "fcfs",
            lambda: [client("heavy", args.heavy_k), client("light", args.light_k)],
            args.duration_s,
        ),
        "solo": ("fair", lambda: [client("light", args.light_k)], args.short_duration_s),
        "weighted": (
            "fair",
            lambda: [client(f"w{i}", args.weighted_k, weight=float(i)) for i in (1, 2, 3, 4)],
            args.duration_s,
        ),
        "priority": (
            "fair",
            lambda: [
                client("bulk", args.bulk_k, priority=1),
                client("vip", 1, priority=0, pause_s=args.vip_pause_s, output_range=(16, 32)),
            ],
            args.duration_s,
        ),
        "priority_idle": (
            "fair",
            lambda: [client("vip", 1, priority=0, pause_s=args.vip_pause_s, output_range=(16, 32))],
            args.short_duration_s,
        ),
    }
    wanted = [r for r in args.runs.split(",") if r]
    runs: dict[str, RunResult] = {}
    t0 = time.perf_counter()
    for name in wanted:
        policy, make_clients, duration = plans[name]
        runs[name] = r = run(name, policy, make_clients(), duration, model_dir, args)
        log(
            f"[{name}] done: {r.steps} steps, load average {r.loadavg[0]:.2f} -> {r.loadavg[1]:.2f}, "
            f"CPU/wall {r.cpu_per_wall:.2f}, other processes' CPU/wall {r.other_cpu_per_wall or 0:.2f}"
        )
    log(f"all runs done in {time.perf_counter() - t0:.0f}s")

    result: dict[str, object] = {
        "bench": "fairness",
        "model": model_dir.name,
        "params_m": round(num_parameters(model_dir) / 1e6, 1),
        "dtype": "float32",
        "device": "cpu",
        "threads": args.threads,
        "seed": args.seed,
        "window_s": args.window_s,
        "duration_s": args.duration_s,
        "short_duration_s": args.short_duration_s,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "k": {"heavy": args.heavy_k, "light": args.light_k, "weighted": args.weighted_k, "bulk": args.bulk_k},
    }
    figures: dict[str, float] = {}
    if "fair" in runs:
        fair = runs["fair"]
        figures["jain_min"] = min(
            jain(h, li)
            for h, li in zip(window_rates(fair, "heavy"), window_rates(fair, "light"), strict=True)
        )
        figures["jain_whole_run"] = jain(rate(fair, "service", "heavy"), rate(fair, "service", "light"))
        if "fcfs" in runs:
            fcfs = runs["fcfs"]
            figures["service_gap_vs_fcfs"] = mean_gap(fair) / mean_gap(fcfs)
            figures["light_p90_ttft_vs_fcfs"] = p90(fair.ttft["light"]) / p90(fcfs.ttft["light"])
            figures["throughput_vs_fcfs"] = output_tok_s(fair) / output_tok_s(fcfs)
            # The same comparison per engine step, which other load on a shared machine does not move.
            figures["tokens_per_step_vs_fcfs"] = (
                sum(sum(w["output"].values()) for w in measured(fair)) / max(fair.measured_steps, 1)
            ) / (sum(sum(w["output"].values()) for w in measured(fcfs)) / max(fcfs.measured_steps, 1))
            figures["jain_min_fcfs"] = min(
                jain(h, li)
                for h, li in zip(window_rates(fcfs, "heavy"), window_rates(fcfs, "light"), strict=True)
            )
        if "solo" in runs:
            figures["light_p90_ttft_vs_solo"] = p90(fair.ttft["light"]) / p90(runs["solo"].ttft["light"])
    if "weighted" in runs:
        wr = runs["weighted"]
        tenants = ["w1", "w2", "w3", "w4"]
        total_w = 10.0
        total = sum(rate(wr, "service", t) for t in tenants)
        shares = {t: rate(wr, "service", t) / total for t in tenants}
        figures["weighted_share_max_error"] = max(
            abs(shares[t] - (i + 1) / total_w) for i, t in enumerate(tenants)
        )
        worst = 0.0
        for win in measured(wr):
            s = sum(win["service"][t] for t in tenants)
            worst = max(
                worst, *(abs(win["service"][t] / s - (i + 1) / total_w) for i, t in enumerate(tenants))
            )
        figures["weighted_share_max_error_worst_window"] = worst
        result["weighted_shares"] = {t: round(v, 4) for t, v in shares.items()}
    if "priority" in runs and "priority_idle" in runs:
        figures["priority_p90_ttft_vs_idle"] = p90(runs["priority"].ttft["vip"]) / p90(
            runs["priority_idle"].ttft["vip"]
        )
    result.update({k: round(v, 4) for k, v in figures.items()})
    result["runs"] = {name: summary(r) for name, r in runs.items()}
    result["targets"] = {k: f"{op} {v:g}" for k, (op, v) in TARGETS.items()}
    met = {}
    for key, (op, bound) in TARGETS.items():
        if key in figures:
            v = figures[key]
            met[key] = bool(v >= bound if op == ">=" else v <= bound)
    result["met"] = met
    for key in TARGETS:
        if key in figures:
            log(
                f"{key}: {figures[key]:.3f} (target {TARGETS[key][0]} {TARGETS[key][1]:g}) "
                f"{'ok' if met[key] else 'MISSED'}"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
