"""Structured outputs: output tokens/s of a json_schema workload against the same workload free, in
one run on one engine, and grammar compile time per schema.

The workload: one chat request per schema of the test corpus (tests/structured_schemas.py, nested
objects, enums, arrays, bounded numbers, patterns), asking SmolLM2-135M-Instruct for an example as
JSON, greedy. The constrained pass generates under each schema's grammar; the free pass asks the
same prompts for exactly as many tokens as each constrained answer had (ignore_eos), so both passes
compute the same tokens in the same batches and differ only by the grammar work (compile in its
thread, one bitmask per constrained row per step, matcher updates). Passes alternate, free first;
the first constrained pass compiles every grammar (cold), the later ones hit the cache.
The prefix cache is off, so every pass prefills every prompt.

Compile time: every schema compiled once more by a fresh manager (no cache), one after another.

    OMP_NUM_THREADS=2 .venv/bin/python bench/structured_output.py
    OMP_NUM_THREADS=2 .venv/bin/python bench/structured_output.py --repeat 1 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import ROOT, log, percentile, real_model_dir  # noqa: E402

sys.path.insert(0, str(ROOT))


def run_pass(engine, prompts: list[list[int]], params: list) -> tuple[float, list]:
    started = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, p)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    elapsed = time.perf_counter() - started
    return elapsed, [finished[k] for k in sorted(finished, key=lambda r: int(r.rsplit("-", 1)[1]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeat", type=int, default=2, help="alternating free/constrained pass pairs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import jsonschema

    from engine.chat_template import chat_prompt_token_ids
    from engine.llm import engine_config_from_kwargs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.structured_output.manager import StructuredOutputManager
    from tests.structured_schemas import SCHEMAS

    model_dir = real_model_dir()
    engine = LLMEngine(
        # No prefix cache: every pass prefills every prompt, so the first (cold-grammar) pass is
        # not slower than the rest for want of cached prompts.
        engine_config_from_kwargs(
            str(model_dir),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
        )
    )
    prompts = [
        chat_prompt_token_ids(
            engine.tokenizer,
            [
                {
                    "role": "user",
                    "content": f"Give an example {name.replace('_', ' ')} as JSON for: {json.dumps(s)}",
                }
            ],
        )
        for name, s in SCHEMAS
    ]
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs={"json": s})
        for _, s in SCHEMAS
    ]
    # Warm-up: the forward's first calls, outside every timed pass.
    run_pass(engine, prompts[:4], [SamplingParams(temperature=0.0, max_tokens=8)] * 4)

    lengths: list[int] | None = None
    free_times, constrained_times, valid = [], [], 0
    for round_ in range(args.repeat):
        if lengths is not None:
            free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
            elapsed, _ = run_pass(engine, prompts, free)
            free_times.append(elapsed)
            log(f"round {round_}: free {sum(lengths)} tokens in {elapsed:.2f} s")
        elapsed, outs = run_pass(engine, prompts, constrained)
        constrained_times.append(elapsed)
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths is None or counts == lengths, "greedy constrained outputs changed between passes"
        lengths = counts
        log(f"round {round_}: constrained {sum(counts)} tokens in {elapsed:.2f} s")
        if round_ == 0:
            for (_, schema), out in zip(SCHEMAS, outs, strict=True):
                try:
                    jsonschema.validate(json.loads(out.outputs[0].text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
    # The free pass of the first round could not run before the lengths were known: one more.
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    elapsed, _ = run_pass(engine, prompts, free)
    free_times.append(elapsed)
    log(f"last: free {sum(lengths)} tokens in {elapsed:.2f} s")

    fresh = StructuredOutputManager(
        engine.tokenizer, vocab_size=engine.vocab_size, eos_token_ids=engine.eos_token_ids
    )
    for _, schema in SCHEMAS:
        fresh.grammar({"json": schema, "disable_any_whitespace": True}).future.result()
    compile_ms = [s * 1000 for s in fresh.compile_seconds]
    fresh.shutdown()
    tokens = sum(lengths)
    free_tok_s = tokens / min(free_times)
    cold_tok_s = tokens / constrained_times[0]
    cached_tok_s = tokens / min(constrained_times[1:]) if len(constrained_times) > 1 else cold_tok_s
    result = {
        "bench": "structured_output",
        "model": "SmolLM2-135M-Instruct float32",
        "requests": len(SCHEMAS),
        "output_tokens": tokens,
        "valid_json": f"{valid}/{len(SCHEMAS)}",
        "free_tok_s": round(free_tok_s, 1),
        "constrained_cold_tok_s": round(cold_tok_s, 1),
        "constrained_cached_tok_s": round(cached_tok_s, 1),
        "ratio_cold": round(cold_tok_s / free_tok_s, 3),
        "ratio_cached": round(cached_tok_s / free_tok_s, 3),
        "compile_ms_p50": round(percentile(compile_ms, 50), 2),
        "compile_ms_p99": round(percentile(compile_ms, 99), 2),
        "compile_ms_max": round(max(compile_ms), 2),
        "threads": args.threads,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
