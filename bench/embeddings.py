"""Embedding throughput and latency: Pagoda's embedding engine against sentence-transformers'
`encode`, on all-MiniLM-L6-v2 (an encoder, mean pooling) or, with --model smollm2, on
SmolLM2-135M run as an embedding model built on a decoder (last-token pooling, normalized: what
`--task embed` serves), the same texts, the same CPU threads, in one process.

Texts of mixed lengths (4 to 400 tokens, drawn from real words) are embedded two ways:
- batch 64: requests of 64 texts each, one after another;
- batch 1: one text per request.
Pagoda's figures include tokenization (the web tier's work; the fast tokenizer over the batch) and
the engine (packed inputs, no padding); sentence-transformers' are `encode` with its defaults (it
sorts by length and pads per batch of 32). Both give the same vectors (the least cosine over the
first 64 texts is reported). With --vllm-python, vLLM's CPU build (its pooling runner, `LLM.embed`,
offline) embeds the same batches in a process of its own, its tokenization included.

Prints progress on stderr and a final JSON line: texts/s and p50 latency per side and batch size,
and the ratios.

    OMP_NUM_THREADS=2 .venv/bin/python bench/embeddings.py
    OMP_NUM_THREADS=2 .venv/bin/python bench/embeddings.py --vllm-python ~/.cache/pagoda/vllm-venv/bin/python
    OMP_NUM_THREADS=2 .venv/bin/python bench/embeddings.py --model smollm2 --texts 128 \
        --vllm-python ~/.cache/pagoda/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import log  # noqa: E402

MAX_LEN = 512  # tokens an input may hold, on every side

WORDS = (
    "river mountain quiet library engine window garden thunder lantern bridge market winter copper "
    "violin harbor meadow signal orbit candle forest ladder puzzle marble desert village journey "
    "harvest compass silver whisper shadow crystal ocean canyon feather pillow rocket saddle"
).split()


def make_texts(tokenizer: Any, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        target = int(rng.choice([4, 8, 16, 32, 64, 128, 256, 400]) * rng.uniform(0.7, 1.0))
        words = rng.choices(WORDS, k=target)
        ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][: max(target - 2, 1)]
        texts.append(tokenizer.decode(ids))
    return texts


def pagoda_side(engine: Any, tokenizer: Any, batches: list[list[str]]) -> tuple[list[float], list[Any]]:
    """Seconds per request (tokenize and embed), and the vectors."""
    import base64

    import numpy as np

    times, vectors = [], []
    for i, batch in enumerate(batches):
        started = time.perf_counter()
        ids = tokenizer(batch, truncation=True, max_length=MAX_LEN)["input_ids"]
        engine.add_embedding_request(f"r{i}", ids, tenant="bench")
        done = None
        while done is None:
            for output in engine.step():
                done = output
        times.append(time.perf_counter() - started)
        vectors += [np.frombuffer(base64.b64decode(v), dtype="<f4") for v in done.embeddings]
    return times, vectors


def st_side(model: Any, batches: list[list[str]]) -> tuple[list[float], list[Any]]:
    times, vectors = [], []
    for batch in batches:
        started = time.perf_counter()
        out = model.encode(batch, batch_size=32, convert_to_numpy=True)
        times.append(time.perf_counter() - started)
        vectors += list(out)
    return times, vectors


VLLM_CHILD = """
import json, sys, time
from vllm import LLM
args = json.loads(open(sys.argv[1]).read())
llm = LLM(model=args["model"], runner="pooling", dtype="float32", max_model_len=512, enforce_eager=True,
          **args["options"])
llm.embed(args["batches"][0][:8], use_tqdm=False)  # warm-up
out = {"vectors": [o.outputs.embedding for o in llm.embed(args["check"], use_tqdm=False)]}
for size, batches in args["by_size"].items():
    runs = []
    for _ in range(args["rounds"]):
        times = []
        for batch in batches:
            start = time.perf_counter()
            llm.embed(batch, use_tqdm=False)
            times.append(time.perf_counter() - start)
        runs.append(times)
    out[size] = runs
print("RESULT " + json.dumps(out))
"""


def vllm_side(
    vllm_python: str,
    model_dir: Path,
    by_size: dict[int, list[list[str]]],
    check: list[str],
    rounds: int,
) -> dict[str, Any]:
    import os
    import subprocess
    import tempfile

    from common import vllm_env

    payload = {
        "model": str(model_dir),
        "by_size": {str(k): v for k, v in by_size.items()},
        "batches": next(iter(by_size.values())),
        "check": check,
        "rounds": rounds,
        # No prefix cache (vLLM keeps one for last-token pooling): every round embeds the same
        # texts, and Pagoda's embedding engine computes each input whole. A decoder's vectors are
        # its last token's, normalized, by vLLM's default (checked against Pagoda's below).
        "options": {"enable_prefix_caching": False},
    }
    env = vllm_env(vllm_python, threads=int(os.environ.get("OMP_NUM_THREADS", "2")), kv_cache_gib=1)
    # vLLM takes sentence_bert_config.json's max_seq_length (256) as the model's limit; the texts
    # here reach 400 tokens, within the model's 512 positions, as on the other two sides.
    env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as payload_file:  # too long for an argument
        json.dump(payload, payload_file)
        payload_file.flush()
        proc = subprocess.run(
            [vllm_python, "-c", VLLM_CHILD, payload_file.name], env=env, capture_output=True, text=True
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        log(proc.stderr[-3000:])
        return {"error": f"vLLM's embed run failed (exit {proc.returncode})"}
    return json.loads(lines[-1][len("RESULT ") :])


def figures(times: list[float], texts: int) -> dict[str, float]:
    return {
        "texts_per_s": round(texts / sum(times), 1),
        "latency_p50_ms": round(1000 * statistics.median(times), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--texts", type=int, default=512, help="texts per batch size and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="the python of a venv with vLLM's CPU build")
    parser.add_argument(
        "--model",
        choices=("minilm", "smollm2"),
        default="minilm",
        help="minilm: all-MiniLM-L6-v2; smollm2: SmolLM2-135M embedding with last-token pooling",
    )
    args = parser.parse_args()
    from engine.allocator import reexec_as_engine_process

    # As an engine process runs (engine.allocator), and as vLLM's side runs (bench.common.vllm_env);
    # sentence-transformers, in this process, gets it too.
    reexec_as_engine_process(sys.argv)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from engine.config import EngineConfig, SchedulerConfig
    from engine.demo_model import (
        default_embedding_model_dir,
        default_model_dir,
        fetch_demo_model,
        fetch_embedding_model,
    )
    from engine.embedding_engine import EmbeddingEngine

    torch.set_num_threads(args.threads)
    decoder = args.model == "smollm2"
    if decoder:
        from sentence_transformers import models

        model_dir = fetch_demo_model(default_model_dir("float32"), dtype="float32", progress=False)
        # Texts as plain text: sentence-transformers would otherwise wrap each in the chat template
        # of this instruct model (a "message"), which an embedding request does not.
        body = models.Transformer(
            str(model_dir),
            max_seq_length=MAX_LEN,
            modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
            module_output_name="token_embeddings",
        )
        pooling = models.Pooling(body.get_embedding_dimension(), pooling_mode="lasttoken")
        reference = SentenceTransformer(modules=[body, pooling, models.Normalize()], device="cpu")
    else:
        model_dir = fetch_embedding_model(default_embedding_model_dir())
        reference = SentenceTransformer(str(model_dir), device="cpu")
        reference.max_seq_length = MAX_LEN
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = EmbeddingEngine.from_config(
        EngineConfig(
            model=str(model_dir),
            task="embed",
            device="cpu",
            scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=64, max_model_len=MAX_LEN),
        )
    )
    texts = make_texts(tokenizer, args.texts, seed=0)
    log(
        f"{len(texts)} texts, {sum(len(tokenizer(t)['input_ids']) for t in texts)} tokens; {args.threads} threads"
    )
    # Warm-up, and the check that both sides compute the same vectors.
    ours = pagoda_side(engine, tokenizer, [texts[:64]])[1]
    theirs = st_side(reference, [texts[:64]])[1]
    cosine = min(
        float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        for a, b in zip(ours, theirs, strict=True)
    )
    log(f"min cosine over 64 texts: {cosine:.7f}")
    results: dict[str, dict[str, list[float]]] = {}
    by_size = {
        size: [
            texts[i : i + size] for i in range(0, len(texts) if size == 64 else min(len(texts), 128), size)
        ]
        for size in (64, 1)
    }
    for batch_size in (64, 1):
        count = len(texts) if batch_size == 64 else min(len(texts), 128)
        batches = by_size[batch_size]
        for r in range(args.rounds):
            order = [("pagoda", pagoda_side), ("sentence_transformers", st_side)]
            if r % 2:
                order.reverse()
            for name, side in order:
                target = engine if name == "pagoda" else reference
                times = side(target, tokenizer, batches)[0] if name == "pagoda" else side(target, batches)[0]
                results.setdefault(f"{name}_batch{batch_size}", {}).setdefault("runs", []).append(
                    figures(times, count)["texts_per_s"]
                )
                results[f"{name}_batch{batch_size}"].setdefault("latency", []).extend(times)
                log(f"batch {batch_size} round {r + 1} {name}: {figures(times, count)}")
    out: dict[str, Any] = {
        "model": args.model,
        "min_cosine": round(cosine, 7),
        "threads": args.threads,
        "texts": len(texts),
    }
    for key, value in results.items():
        out[key] = {
            "texts_per_s": round(statistics.median(value["runs"]), 1),
            "latency_p50_ms": round(1000 * statistics.median(value["latency"]), 2),
        }
    for batch_size in (64, 1):
        ours_tps = out[f"pagoda_batch{batch_size}"]["texts_per_s"]
        out[f"ratio_batch{batch_size}"] = round(
            ours_tps / out[f"sentence_transformers_batch{batch_size}"]["texts_per_s"], 2
        )
    if args.vllm_python:
        log("vLLM's CPU build: the same batches")
        vllm = vllm_side(args.vllm_python, model_dir, by_size, texts[:64], args.rounds)
        if "error" in vllm:
            out["vllm"] = vllm
        else:
            out["vllm_min_cosine"] = round(
                min(
                    float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
                    for a, b in zip(ours, vllm["vectors"], strict=True)
                ),
                7,
            )
            for batch_size in (64, 1):
                count = sum(len(b) for b in by_size[batch_size])
                runs = vllm[str(batch_size)]
                out[f"vllm_batch{batch_size}"] = {
                    "texts_per_s": round(statistics.median(count / sum(times) for times in runs), 1),
                    "latency_p50_ms": round(1000 * statistics.median(t for times in runs for t in times), 2),
                }
                out[f"vs_vllm_batch{batch_size}"] = round(
                    out[f"pagoda_batch{batch_size}"]["texts_per_s"]
                    / out[f"vllm_batch{batch_size}"]["texts_per_s"],
                    2,
                )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
