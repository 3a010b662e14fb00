"""``python -m engine serve`` (also ``python -m engine.serve``): run one engine replica of one model.

Loads the model, then serves its Redis request stream until SIGTERM or SIGINT, which drain: nothing
new is taken, the requests taken but not started go back to the model's stream at once (another
replica takes them), running ones get --drain-grace-s to finish, the heartbeat says `draining` until
the heartbeat is removed, and the exit status is 0. When the grace period ends, or at a second
signal, it stops at once: every request it holds is handed back, and the replica that takes one
that streamed continues it (at most --max-failovers times per request; with 0, such a request
gets an error event, engine_shutdown). Exit status 1 means the engine failed; a process supervisor is expected to restart it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine import rules
from engine.allocator import reexec_as_engine_process
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)
from engine.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.worker.health import Health


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '2GiB', '1.5GB' (the rule in engine.rules)."""
    try:
        return rules.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The serve options; pass a subparser to mount them under ``python -m engine serve``."""
    parser = parser or argparse.ArgumentParser(
        prog="python -m engine serve", description=__doc__.splitlines()[0]
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model-dir", required=True, help="Hugging Face model directory")
    model.add_argument("--served-name", required=True, help="the name clients put in `model`")
    model.add_argument(
        "--task",
        default="auto",
        choices=("auto", "generate", "embed"),
        help="embed: compute embeddings (/v1/embeddings); auto: embed for an encoder, else generate",
    )
    model.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    model.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    model.add_argument("--max-model-len", type=int, default=None)
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    cache = parser.add_argument_group("KV cache and scheduling")
    size = cache.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None)
    size.add_argument("--kv-cache-memory", type=parse_size, default=None, help="bytes, or e.g. 512MiB")
    cache.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    cache.add_argument("--block-size", type=int, default=16)
    cache.add_argument("--no-prefix-caching", action="store_true")
    cache.add_argument("--max-num-seqs", type=int, default=128)
    cache.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cache.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=None,
        help="sequences (n) one request may run, below max-num-seqs; default: a quarter of it",
    )
    cache.add_argument(
        "--fair-preempt-tokens-per-step",
        type=int,
        default=None,
        help="computed tokens fair-share preemption may throw away per step (a bucket of at most"
        " max-model-len); default: a quarter of max-num-batched-tokens; 0: never preempt for fair share",
    )
    cache.add_argument(
        "--shared-step-slowdown",
        type=float,
        default=SchedulerConfig().shared_step_slowdown,
        help="while several tenants are present, a step's decodes and prompt tokens stay within this"
        " multiple of the least demanding tenant's own step; the widest tenants take turns; 0: no bound",
    )
    cache.add_argument(
        "--decode-fixed-rows",
        type=float,
        default=None,
        help="a decode step's fixed cost in rows of per-sequence cost (for --shared-step-slowdown);"
        " default: measured at warm-up on CPU, none on a GPU",
    )
    cache.add_argument(
        "--prompt-token-rows",
        type=float,
        default=None,
        help="a prompt token's cost in rows of per-sequence cost (for --shared-step-slowdown);"
        " default: measured at warm-up on CPU, none on a GPU",
    )
    for flag, what in (
        ("--decode-key-rows", "a decoded sequence's key past the first 100"),
        ("--prompt-key-rows", "a key a prompt token attends"),
        ("--prompt-logprob-rows", "a prompt token scored for prompt logprobs"),
    ):
        cache.add_argument(
            flag,
            type=float,
            default=None,
            help=f"the cost of {what}, in rows of per-sequence cost (for --shared-step-slowdown);"
            " default: measured at warm-up on CPU, none on a GPU",
        )
    cache.add_argument(
        "--max-prefill-tokens-with-decodes",
        type=int,
        default=0,
        help="prompt tokens a step computes at most while sequences decode (bounds the longest gap"
        " between a stream's tokens as prompts arrive); 0: up to max-num-batched-tokens",
    )
    cache.add_argument(
        "--lower-tier-prefill-tokens",
        type=int,
        default=SchedulerConfig().lower_tier_prefill_tokens,
        help="prompt tokens a step gives less important tiers (flex: batch lines) while a more"
        " important one runs, none while its prompt starts; -1: no cap",
    )
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", help="serve requests that name an adapter")
    lora.add_argument("--max-loras", type=int, default=4, help="adapters resident on the device at once")
    lora.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in host memory; default 4 x max-loras"
    )
    lora.add_argument("--max-lora-rank", type=int, default=64)
    grammar = parser.add_argument_group("structured outputs (bounds on a grammar's cost)")
    bounds = StructuredOutputConfig()  # the defaults are the engine's own
    grammar.add_argument("--grammar-compile-timeout-s", type=float, default=bounds.compile_timeout_s)
    grammar.add_argument(
        "--grammar-max-compiles", type=int, default=bounds.max_compiles, help="compile processes"
    )
    grammar.add_argument(
        "--grammar-max-compiles-per-tenant", type=int, default=bounds.max_compiles_per_tenant
    )
    grammar.add_argument(
        "--grammar-compile-nice",
        type=int,
        default=bounds.compile_nice,
        help="nice value of a compile still running after its first moments (0: never lowered)",
    )
    grammar.add_argument(
        "--grammar-max-mask-ms", type=float, default=bounds.max_mask_ms, help="CPU ms one token mask may take"
    )
    grammar.add_argument(
        "--grammar-max-request-mask-ms",
        type=float,
        default=bounds.max_request_mask_ms,
        help="CPU ms one step's masks for one request may take (mask cost x n)",
    )
    grammar.add_argument("--grammar-cache-bytes", type=parse_size, default=bounds.cache_bytes)
    spec = parser.add_argument_group("speculative decoding (n-gram prompt lookup, or a draft model)")
    spec_defaults = SpeculativeConfig()
    spec.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="draft tokens proposed from the sequence's own prompt and output and verified per step"
        f" (0: off; {spec_defaults.num_speculative_tokens} is a good start)",
    )
    spec.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=spec_defaults.prompt_lookup_min,
        help="shortest suffix n-gram looked up",
    )
    spec.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=spec_defaults.prompt_lookup_max,
        help="longest suffix n-gram looked up",
    )
    spec.add_argument(
        "--speculative-draft-model",
        default=None,
        help="a smaller model of the same tokenizer whose greedy decoding proposes the drafts"
        " instead of n-gram lookup (with --num-speculative-tokens)",
    )
    spec.add_argument(
        "--speculative-draft-blocks",
        type=int,
        default=spec_defaults.draft_num_blocks,
        help="KV cache blocks of the draft model",
    )
    redis_opts = parser.add_argument_group("Redis")
    redis_opts.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        required="REDIS_URL" not in os.environ,
        help="default: $REDIS_URL (keeps a password off the command line)",
    )
    redis_opts.add_argument("--redis-prefix", default="pagoda:")
    redis_opts.add_argument("--replica-id", default="", help="default: host-pid-random")
    redis_opts.add_argument("--claim-timeout-ms", type=int, default=15_000)
    redis_opts.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    redis_opts.add_argument("--heartbeat-ttl", type=float, default=5.0, help="seconds")
    redis_opts.add_argument("--output-ttl", type=int, default=600, help="seconds an output stream lives")
    redis_opts.add_argument(
        "--max-held", type=int, default=0, help="requests taken at once; 0: 2 x max-num-seqs"
    )
    redis_opts.add_argument(
        "--max-failovers",
        type=int,
        default=2,
        help="times a streaming request may be continued by another replica after losing its own",
    )
    redis_opts.add_argument(
        "--steal-after-ms",
        type=int,
        default=500,
        help="an idle replica takes requests routed to another replica that waited this long; 0: never",
    )
    redis_opts.add_argument(
        "--no-step-interrupts",
        action="store_true",
        help="never give up a spare-capacity (flex) step when a more important request arrives",
    )
    redis_opts.add_argument(
        "--quiet-publish-s",
        type=float,
        default=1.0,
        help="seconds a non-streamed request's output may wait to be published after its first "
        "tokens (it goes at its end, or this often); 0: every step",
    )
    redis_opts.add_argument(
        "--drain-grace-s",
        type=float,
        default=30.0,
        help="seconds a draining replica (first SIGTERM) gives its running requests",
    )
    health = parser.add_argument_group("health port")
    health.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="serve GET /live and /ready on this port (engine.worker.health); 0: none",
    )
    health.add_argument("--health-host", default="0.0.0.0", help="the address the health port binds")
    parser.add_argument("--log-level", default="INFO")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    max_model_len = args.max_model_len or 2048
    return EngineConfig(
        model=args.model_dir,
        task=args.task,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
            lower_tier_prefill_tokens=None
            if args.lower_tier_prefill_tokens < 0
            else args.lower_tier_prefill_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            max_seqs_per_request=args.max_seqs_per_request,
            fair_preempt_tokens_per_step=args.fair_preempt_tokens_per_step,
            shared_step_slowdown=args.shared_step_slowdown,
            decode_fixed_rows=args.decode_fixed_rows,
            prompt_token_rows=args.prompt_token_rows,
            decode_key_rows=args.decode_key_rows,
            prompt_key_rows=args.prompt_key_rows,
            prompt_logprob_rows=args.prompt_logprob_rows,
        ),
        lora=lora_config_from_args(args),
        structured_output=StructuredOutputConfig(
            compile_timeout_s=args.grammar_compile_timeout_s,
            max_compiles=args.grammar_max_compiles,
            max_compiles_per_tenant=args.grammar_max_compiles_per_tenant,
            compile_nice=args.grammar_compile_nice,
            max_mask_ms=args.grammar_max_mask_ms,
            max_request_mask_ms=args.grammar_max_request_mask_ms,
            cache_bytes=args.grammar_cache_bytes,
        ),
        speculative=speculative_config_from_args(args),
    )


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.num_speculative_tokens < 0:
        raise ConfigError(f"num_speculative_tokens must be >= 0, got {args.num_speculative_tokens}")
    if args.num_speculative_tokens == 0:
        if args.speculative_draft_model is not None:
            raise ConfigError("--speculative-draft-model needs --num-speculative-tokens (the draft's length)")
        return None
    return SpeculativeConfig(
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        draft_model=args.speculative_draft_model,
        draft_num_blocks=args.speculative_draft_blocks,
    )


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    max_cpu_loras = args.max_cpu_loras if args.max_cpu_loras is not None else 4 * args.max_loras
    return LoRAConfig(max_loras=args.max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=args.max_lora_rank)


def worker_settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    return WorkerSettings(
        model=args.served_name,
        prefix=args.redis_prefix,
        replica_id=args.replica_id,
        claim_timeout_ms=args.claim_timeout_ms,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_ttl_s=args.heartbeat_ttl,
        output_ttl_s=args.output_ttl,
        max_held=args.max_held or 2 * args.max_num_seqs,
        drain_grace_s=args.drain_grace_s,
        max_failovers=args.max_failovers,
        steal_after_ms=args.steal_after_ms,
        step_interrupts=not args.no_step_interrupts,
        quiet_publish_s=args.quiet_publish_s,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = engine_config_from_args(args)
        settings = worker_settings_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from engine.worker.health import Health, HealthServer

    # Installed before the (slow) model load, so a stop during loading is honoured once it is done.
    health = Health(model=settings.model, replica_id=settings.replica_id)
    stop_requests: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stop_requests.append(signum)
        if health.worker is not None:
            health.worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Up before the model loads: the startup probe sees "starting", not a refused connection.
    health_server: HealthServer | None = None
    if args.health_port:
        try:
            health_server = HealthServer(health, host=args.health_host, port=args.health_port)
        except OSError as exc:
            print(f"error: cannot serve the health port {args.health_port}: {exc}", file=sys.stderr)
            return 2
        health_server.start()
    try:
        return _load_and_serve(args, config, settings, health, stop_requests)
    finally:
        if health_server is not None:
            health_server.stop()


def _load_and_serve(
    args: argparse.Namespace,
    config: EngineConfig,
    settings: WorkerSettings,
    health: Health,
    stop_requests: list[int],
) -> int:
    import redis

    from engine.embedding_engine import EmbeddingEngine
    from engine.errors import EngineError
    from engine.llm_engine import LLMEngine
    from engine.models.bert import is_encoder
    from engine.worker.loop import EngineWorker
    from engine.worker.queue import RequestQueue

    log = logging.getLogger("engine.serve")
    try:
        # An encoder (BERT family) computes embeddings; a decoder generates unless told to embed.
        engine: LLMEngine | EmbeddingEngine
        encoder = is_encoder(config.model)
        if encoder and config.task == "generate":
            raise ConfigError(f"{config.model} is an encoder (BERT family): it embeds, it cannot generate")
        embed = encoder or config.task == "embed"
        engine = (EmbeddingEngine if embed else LLMEngine).from_config(config)
    except (EngineError, ConfigError) as exc:  # a bad model directory or setting: say so, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    client = redis.Redis.from_url(args.redis_url, decode_responses=False)
    queue = RequestQueue(
        client,
        prefix=settings.prefix,
        model=settings.model,
        replica_id=settings.replica_id,
        output_ttl_s=settings.output_ttl_s,
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
    )
    worker = EngineWorker(engine, queue, settings)
    earlier = len(stop_requests)  # those that came while loading; later ones reach the worker
    health.worker = worker
    for _ in range(earlier):
        worker.request_stop()
    log.info("serving %s from %s as replica %s", settings.model, args.model_dir, settings.replica_id)
    status = worker.run()
    log.info("replica %s stopped (exit status %d)", settings.replica_id, status)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A process of its own (python -m engine.serve): its allocator and OpenMP spin can still be set.
    if argv is None:
        reexec_as_engine_process(["-m", "engine.serve", *sys.argv[1:]])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
