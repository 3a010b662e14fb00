"""Serving metrics for Prometheus.

Labels stay bounded: tenant slug and served model name (a name that is not deployed is counted as
"-", so a client cannot mint series by inventing model names), an error code from a fixed set, the
tenant's own ready adapters (capped per tenant), never a request id. Engine gauges are read from
the replicas' heartbeats at scrape time.
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

_LABELS = ["tenant", "model"]
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)

REQUESTS = Counter("pagoda_requests_total", "Generation requests admitted", [*_LABELS, "status"])
PROMPT_TOKENS = Counter("pagoda_prompt_tokens_total", "Prompt tokens billed", _LABELS)
COMPLETION_TOKENS = Counter("pagoda_completion_tokens_total", "Completion tokens billed", _LABELS)
CACHED_TOKENS = Counter("pagoda_cached_tokens_total", "Prompt tokens served from the prefix cache", _LABELS)
ERRORS = Counter(
    "pagoda_request_errors_total", "Generation requests that failed or were refused", [*_LABELS, "code"]
)
TIME_TO_FIRST_TOKEN = Histogram(
    "pagoda_time_to_first_token_seconds",
    "From request arrival to the first token",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "pagoda_inter_token_latency_seconds", "Between successive token deliveries", _LABELS, buckets=_ITL_BUCKETS
)
# Requests naming a LoRA adapter, per adapter. Adapter names reach a label only once resolved to a
# ready adapter of the caller's tenant, and a tenant keeps at most PAGODA_ADAPTER_MAX_PER_TENANT.
ADAPTER_REQUESTS = Counter(
    "pagoda_adapter_requests_total",
    "Generation requests that used a LoRA adapter",
    [*_LABELS, "adapter", "status"],
)
ADAPTER_TOKENS = Counter(
    "pagoda_adapter_tokens_total",
    "Prompt plus completion tokens of requests that used a LoRA adapter",
    [*_LABELS, "adapter"],
)
# Where a request's time to first token went inside the engine tier, from the replica's finished
# event (engine.protocol.Event.timing): queued -> taken, taken -> first token. Unix times of two
# processes, possibly on two hosts: the queue time includes their clocks' offset.
_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
QUEUE_TIME = Histogram(
    "pagoda_request_queue_seconds",
    "From the web tier queueing a request to an engine replica taking it",
    _LABELS,
    buckets=_STAGE_BUCKETS,
)
ENGINE_FIRST_TOKEN = Histogram(
    "pagoda_engine_first_token_seconds",
    "From an engine replica taking a request to the end of the step that produced its first token",
    _LABELS,
    buckets=_STAGE_BUCKETS,
)
E2E_LATENCY = Histogram(
    "pagoda_e2e_request_latency_seconds", "From request arrival to its end", _LABELS, buckets=_LATENCY_BUCKETS
)

STREAM_FAILOVERS = Counter(
    "pagoda_stream_failovers_total",
    "Streams continued by another engine replica after losing theirs",
    ["model"],
)
STREAM_FAILOVER_GAP = Histogram(
    "pagoda_stream_failover_gap_seconds",
    "The pause a failover put in a stream: its last token before, to its first token after",
    ["model"],
    buckets=(0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 30, 60, 120),
)
ANONYMOUS = "-"


def record_refused(*, tenant: str | None, model: str | None, code: str) -> None:
    ERRORS.labels(tenant or ANONYMOUS, model or ANONYMOUS, code).inc()


def record_finished(
    *,
    tenant: str,
    model: str,
    status: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    ttft_s: float | None,
    itl_s: list[float],
    latency_s: float,
    error_code: str | None,
    adapter: str | None = None,
) -> None:
    REQUESTS.labels(tenant, model, status).inc()
    if adapter:
        ADAPTER_REQUESTS.labels(tenant, model, adapter, status).inc()
        ADAPTER_TOKENS.labels(tenant, model, adapter).inc(prompt_tokens + completion_tokens)
    PROMPT_TOKENS.labels(tenant, model).inc(prompt_tokens)
    COMPLETION_TOKENS.labels(tenant, model).inc(completion_tokens)
    CACHED_TOKENS.labels(tenant, model).inc(cached_tokens)
    if ttft_s is not None:
        TIME_TO_FIRST_TOKEN.labels(tenant, model).observe(ttft_s)
    itl = INTER_TOKEN_LATENCY.labels(tenant, model)
    for gap in itl_s:
        itl.observe(gap)
    E2E_LATENCY.labels(tenant, model).observe(latency_s)
    if error_code:
        ERRORS.labels(tenant, model, error_code).inc()


def record_engine_timing(*, tenant: str, model: str, timing: dict[str, float]) -> None:
    """A finished event's `timing`; a stage whose times are missing is not observed."""
    queued, taken, first = timing.get("queued"), timing.get("taken"), timing.get("first_token")
    if taken is None:
        return
    if queued:
        QUEUE_TIME.labels(tenant, model).observe(max(0.0, taken - queued))
    if first is not None:
        ENGINE_FIRST_TOKEN.labels(tenant, model).observe(max(0.0, first - taken))


def record_failover(*, model: str, gap_s: float) -> None:
    STREAM_FAILOVERS.labels(model).inc()
    STREAM_FAILOVER_GAP.labels(model).observe(gap_s)


class EngineCollector(Collector):
    """Per-model gauges summed (or averaged) over the live replicas, read at scrape time."""

    def describe(self):
        # Without describe() the registry would call collect() at registration, before the
        # database may even exist.
        yield from self._families().values()

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {
            "replicas": GaugeMetricFamily("pagoda_engine_replicas", "Live engine replicas", labels=["model"]),
            "running": GaugeMetricFamily(
                "pagoda_engine_running_requests", "Requests running", labels=["model"]
            ),
            "waiting": GaugeMetricFamily(
                "pagoda_engine_waiting_requests", "Requests waiting", labels=["model"]
            ),
            "kv": GaugeMetricFamily(
                "pagoda_engine_kv_cache_usage", "KV-cache usage, mean over replicas (0..1)", labels=["model"]
            ),
            "hit": GaugeMetricFamily(
                "pagoda_engine_prefix_cache_hit_rate",
                "Prefix-cache hit rate, mean over replicas",
                labels=["model"],
            ),
            "free": GaugeMetricFamily("pagoda_engine_free_kv_blocks", "Free KV blocks", labels=["model"]),
            "total": GaugeMetricFamily("pagoda_engine_total_kv_blocks", "KV blocks", labels=["model"]),
            "drafted": GaugeMetricFamily(
                "pagoda_engine_spec_draft_tokens",
                "Speculative draft tokens verified since the live replicas started",
                labels=["model"],
            ),
            "accepted": GaugeMetricFamily(
                "pagoda_engine_spec_accepted_tokens",
                "Speculative draft tokens accepted since the live replicas started",
                labels=["model"],
            ),
            # Read off the request streams (inference.gateway.queue_depth): what autoscalers watch.
            "queued": GaugeMetricFamily(
                "pagoda_queue_depth",
                "Requests queued for the model that no replica has taken yet",
                labels=["model"],
            ),
            "taken": GaugeMetricFamily(
                "pagoda_queue_pending",
                "Requests a replica of the model has taken and not finished",
                labels=["model"],
            ),
            # Per replica: prefix routing (inference.gateway.routing) at work.
            "routed": GaugeMetricFamily(
                "pagoda_engine_replica_routed_requests",
                "Requests a replica took from its own queue (routed to it by prefix) since it started",
                labels=["model", "replica"],
            ),
            "stolen": GaugeMetricFamily(
                "pagoda_engine_replica_stolen_requests",
                "Requests a replica took from other replicas' queues (they waited past the steal "
                "delay) since it started",
                labels=["model", "replica"],
            ),
            "interrupted": GaugeMetricFamily(
                "pagoda_engine_replica_interrupted_steps",
                "Spare-capacity (flex) steps a replica gave up between layers for a more important "
                "request since it started",
                labels=["model", "replica"],
            ),
            "replica_hit": GaugeMetricFamily(
                "pagoda_engine_replica_prefix_cache_hit_rate",
                "A replica's prefix-cache hit rate",
                labels=["model", "replica"],
            ),
        }

    def collect(self):
        from inference.gateway.queue_depth import queue_depth
        from inference.selectors import deployment_list_enabled, deployment_replicas

        families = self._families()
        try:
            deployments = deployment_list_enabled()
            for deployment in deployments:
                stats = deployment_replicas(name=deployment.name)
                count = len(stats) or 1
                name = [deployment.name]
                families["replicas"].add_metric(name, len(stats))
                families["running"].add_metric(name, sum(s.num_running for s in stats))
                families["waiting"].add_metric(name, sum(s.num_waiting for s in stats))
                families["kv"].add_metric(name, sum(s.kv_cache_usage for s in stats) / count)
                families["hit"].add_metric(name, sum(s.prefix_cache_hit_rate for s in stats) / count)
                families["free"].add_metric(name, sum(s.num_free_blocks for s in stats))
                families["total"].add_metric(name, sum(s.num_total_blocks for s in stats))
                families["drafted"].add_metric(name, sum(s.spec_num_draft_tokens for s in stats))
                families["accepted"].add_metric(name, sum(s.spec_num_accepted_tokens for s in stats))
                depth = queue_depth(deployment.name)
                families["queued"].add_metric(name, depth.waiting)
                families["taken"].add_metric(name, depth.pending)
                for s in stats:
                    labels = [deployment.name, s.replica_id]
                    families["routed"].add_metric(labels, s.num_routed_requests)
                    families["stolen"].add_metric(labels, s.num_stolen_requests)
                    families["interrupted"].add_metric(labels, s.num_interrupted_steps)
                    families["replica_hit"].add_metric(labels, s.prefix_cache_hit_rate)
        except Exception:  # a scrape must not fail because the database or Redis blinked
            logger.exception("could not collect engine gauges")
        yield from families.values()


_engine_collector: EngineCollector | None = None


def register_engine_collector() -> None:
    global _engine_collector
    if _engine_collector is None:
        _engine_collector = EngineCollector()
        REGISTRY.register(_engine_collector)
