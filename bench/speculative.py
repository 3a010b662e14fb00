"""Speculative decoding by n-gram prompt lookup: the engine with it against the same engine without.

SmolLM2-135M-Instruct (float32), chat requests, greedy, up to --max-tokens output tokens each (EOS
ends them). Two workloads of --num-requests requests each:

- grounded: answers that copy spans of their prompt, as summaries, edits and code rewrites do:
  a passage of real text (docstrings of the Python standard library) to repeat, correct or
  reformat, and functions of the standard library to rewrite with a change;
- open: questions and stories with no source text in the prompt to copy from.

Each workload runs at --concurrency levels (default 1 and 8): that many requests in the engine at
once, the next added when one finishes. Both engines are loaded once and take the workloads in
turn (--rounds rounds, the order flipped each round; medians compared), since this machine has
slow spells. Greedy outputs must be identical with and without speculation; the run says whether
they were. Reports per workload and concurrency: output tokens/s of each engine, their ratio,
the acceptance rate (accepted over drafted tokens) and the mean accepted length (tokens a
verification yields: the accepted drafts plus the sampled token).

With --vllm-python, vLLM's CPU build runs the same requests with its `ngram` method and without
(speculative_config method ngram, the same k and lookup lengths), each in a process of its own.

    OMP_NUM_THREADS=2 .venv/bin/python bench/speculative.py
    OMP_NUM_THREADS=2 .venv/bin/python bench/speculative.py --num-requests 4 --rounds 1   # quick
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import log, real_model_dir  # noqa: E402


def grounded_prompts(n: int) -> list[str]:
    """Requests whose answers copy from their prompts: texts and code of the standard library."""
    import difflib
    import json as json_module
    import shlex
    import string
    import textwrap

    texts = [
        " ".join(m.__doc__.split()[:90])
        for m in (difflib, textwrap, shlex, string, json_module)
        if m.__doc__ and len(m.__doc__.split()) > 40
    ]
    functions = [
        textwrap.dedent,
        textwrap.indent,
        shlex.quote,
        shlex.join,
        difflib.get_close_matches,
        string.capwords,
        json_module.dumps,
    ]
    codes = [inspect.getsource(f) for f in functions]
    codes = [c[:1500] for c in codes]
    tasks = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            tasks.append(f"Repeat the following text exactly, word for word:\n\n{texts[i // 4 % len(texts)]}")
        elif kind == 1:
            text = texts[(i // 4 + 1) % len(texts)]
            tasks.append(f"Correct any mistakes in this text and return the whole corrected text:\n\n{text}")
        elif kind == 2:
            code = codes[i // 4 % len(codes)]
            tasks.append(
                f"Rewrite this Python function, renaming its parameters to shorter names, and return"
                f" the whole function:\n\n```python\n{code}```"
            )
        else:
            code = codes[(i // 4 + 3) % len(codes)]
            tasks.append(f"Add a comment above each line of this code:\n\n```python\n{code}```")
    return tasks


OPEN = [
    "Write a short story about a fox who learns to sail.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a birthday party for my grandmother.",
    "What are the advantages of learning a second language?",
    "Describe a walk through a forest in autumn.",
    "How does a refrigerator keep food cold?",
    "Write a poem about the sea at night.",
    "What should I pack for a week of hiking in the mountains?",
]


def open_prompts(n: int) -> list[str]:
    return [
        OPEN[i % len(OPEN)] + ("" if i < len(OPEN) else f" Version {i // len(OPEN) + 1}.") for i in range(n)
    ]


def chat_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]


def chat_workloads(model_dir: Path, num_requests: int) -> dict[str, list[list[int]]]:
    """Both workloads' prompts, rendered by the model's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return {
        "grounded": chat_ids(tokenizer, grounded_prompts(num_requests)),
        "open": chat_ids(tokenizer, open_prompts(num_requests)),
    }


def run_engine(
    engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[float, list]:
    """Seconds to run every prompt, `concurrency` at a time, and the outputs' token ids in order."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    active = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and active < concurrency:
            i = pending.pop(0)
            engine.add_request(f"r{i}-{time.monotonic_ns()}", prompts[i], params)
            active += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id.split("-")[0]] = out.outputs[0].token_ids
                active -= 1
    elapsed = time.perf_counter() - start
    return elapsed, [outputs[f"r{i}"] for i in range(len(prompts))]


def pagoda_engines(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.llm_engine import LLMEngine

    def build(speculative: SpeculativeConfig | None) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(model_dir),
                dtype="float32",
                max_model_len=2048,
                cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=64),
                speculative=speculative,
            )
        )

    spec = SpeculativeConfig(
        num_speculative_tokens=args.k, prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max
    )
    return {"off": build(None), "on": build(spec)}


def bench_pagoda(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = real_model_dir()
    workloads = chat_workloads(model_dir, args.num_requests)
    engines = pagoda_engines(model_dir, args)
    results: dict[str, Any] = {}
    for name, prompts in workloads.items():
        for concurrency in args.concurrency:
            times: dict[str, list[float]] = {"off": [], "on": []}
            tokens: dict[str, list] = {}
            drafted = accepted = drafts = 0
            for r in range(args.rounds):
                order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                for side in order:
                    engine = engines[side]
                    before = engine.get_stats()
                    elapsed, outs = run_engine(engine, prompts, concurrency, args.max_tokens)
                    times[side].append(elapsed)
                    tokens[side] = outs
                    if side == "on":
                        after = engine.get_stats()
                        drafted += int(after["spec_num_draft_tokens"]) - int(before["spec_num_draft_tokens"])
                        accepted += int(after["spec_num_accepted_tokens"]) - int(
                            before["spec_num_accepted_tokens"]
                        )
                        drafts += int(after["spec_num_drafts"]) - int(before["spec_num_drafts"])
            num_tokens = sum(len(t) for t in tokens["off"])
            off = num_tokens / statistics.median(times["off"])
            on = sum(len(t) for t in tokens["on"]) / statistics.median(times["on"])
            key = f"{name}_c{concurrency}"
            results[key] = {
                "output_tokens": num_tokens,
                "tok_s_off": round(off, 1),
                "tok_s_on": round(on, 1),
                "ratio": round(on / off, 3),
                "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else 0.0,
                "identical_outputs": tokens["on"] == tokens["off"],
            }
            log(f"pagoda {key}: {json.dumps(results[key])}")
    return results


VLLM_CHILD = r"""
import json, sys, time, statistics
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
spec = None
if args["speculative"]:
    spec = {"method": "ngram", "num_speculative_tokens": args["k"],
            "prompt_lookup_min": args["lookup_min"], "prompt_lookup_max": args["lookup_max"]}
llm = LLM(model=args["model"], dtype="float32", max_model_len=2048, max_num_seqs=64,
          max_num_batched_tokens=2048, speculative_config=spec, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])
out = {}
for name, prompts in args["workloads"].items():
    for c in args["concurrency"]:
        times, toks = [], None
        for _ in range(args["rounds"]):
            start = time.perf_counter()
            results = []
            for i in range(0, len(prompts), c):
                batch = [{"prompt_token_ids": p} for p in prompts[i:i + c]]
                results += llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            toks = [list(r.outputs[0].token_ids) for r in results]
        out[f"{name}_c{c}"] = {"seconds": statistics.median(times), "tokens": toks}
print("RESULT " + json.dumps(out))
"""


def bench_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM with and without its ngram method: batches of `concurrency` (offline generate)."""
    import os
    import subprocess

    from common import vllm_env

    model_dir = real_model_dir()
    workloads = chat_workloads(model_dir, args.num_requests)
    sides = {}
    for speculative in (False, True):
        payload = {
            "model": str(model_dir),
            "speculative": speculative,
            "k": args.k,
            "lookup_min": args.lookup_min,
            "lookup_max": args.lookup_max,
            "max_tokens": args.max_tokens,
            "workloads": workloads,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
        }
        env = vllm_env(args.vllm_python, threads=int(os.environ.get("OMP_NUM_THREADS", "2")), kv_cache_gib=1)
        proc = subprocess.run(
            [args.vllm_python, "-c", VLLM_CHILD, json.dumps(payload)], env=env, capture_output=True, text=True
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            log(proc.stderr[-3000:])
            return {
                "error": f"vLLM {'with' if speculative else 'without'} ngram failed (exit {proc.returncode})"
            }
        sides["on" if speculative else "off"] = json.loads(lines[-1][len("RESULT ") :])
    results = {}
    for key, off in sides["off"].items():
        on = sides["on"][key]
        n_off, n_on = sum(len(t) for t in off["tokens"]), sum(len(t) for t in on["tokens"])
        results[key] = {
            "tok_s_off": round(n_off / off["seconds"], 1),
            "tok_s_on": round(n_on / on["seconds"], 1),
            "ratio": round((n_on / on["seconds"]) / (n_off / off["seconds"]), 3),
            "identical_outputs": on["tokens"] == off["tokens"],
        }
        log(f"vllm {key}: {json.dumps(results[key])}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=16, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument(
        "--vllm-python", help="a virtualenv's python with vLLM's CPU build (see bench/vs_vllm.py)"
    )
    args = parser.parse_args()
    pagoda = bench_pagoda(args)
    final: dict[str, Any] = {"pagoda": pagoda}
    if args.vllm_python:
        final["vllm"] = bench_vllm(args)
    print(json.dumps(final))


if __name__ == "__main__":
    main()
