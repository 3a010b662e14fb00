"""The step API the worker drives, and the offline LLM on top of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.errors import InvalidRequestError, RequestTooLargeError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.protocol import LoRARef
from engine.sampling_params import SamplingParams

PROMPT = [0, 300, 301, 302, 303, 304, 305, 306, 307]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(num_blocks=32)))


def _drain(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_model_info_comes_from_the_directory(engine: LLMEngine) -> None:
    assert engine.vocab_size == 2048
    assert engine.eos_token_ids == [1, 2]
    assert engine.max_model_len == 2048
    assert engine.tokenizer.decode([300]) != ""


def test_deltas_add_up_to_the_final_output(engine: LLMEngine) -> None:
    engine.add_request(
        "r1", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    )
    outputs = _drain(engine)
    assert all(o.request_id == "r1" for o in outputs)
    final = outputs[-1]
    assert final.finished and [o.finished for o in outputs].count(True) == 1
    c = final.outputs[0]
    assert len(c.token_ids) == 12 and c.finish_reason == "length"
    assert sum((o.outputs[0].token_ids_delta for o in outputs), []) == c.token_ids
    assert "".join(o.outputs[0].text_delta for o in outputs) == c.text
    logprobs = sum((o.outputs[0].logprobs_delta for o in outputs), [])
    assert [lp.token_id for lp in logprobs] == c.token_ids
    assert all(lp.rank == 1 and len(lp.top_logprobs) == 2 for lp in logprobs)  # greedy picks rank 1
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in logprobs))
    assert final.num_prompt_tokens == len(PROMPT)


def test_abort_finishes_the_request_and_frees_its_blocks_at_the_next_step(engine: LLMEngine) -> None:
    total = engine.get_stats()["num_total_blocks"]
    engine.add_request("long", PROMPT * 4, SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    assert engine.get_stats()["num_free_blocks"] < total
    engine.abort_request("long")
    (out,) = engine.step()
    assert out.request_id == "long" and out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_requests"] == 0
    # Freed blocks stay in the prefix cache but count as free.
    assert stats["num_free_blocks"] == total


def test_out_of_vocabulary_tokens_are_refused_and_nothing_is_queued(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("bad", [0, 5000], SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("empty", [], SamplingParams())
    assert not engine.has_unfinished_requests() and engine.get_stats()["num_waiting"] == 0


def test_a_request_larger_than_the_whole_cache_is_refused(engine: LLMEngine) -> None:
    # 32 blocks of 16 tokens hold 512 tokens.
    with pytest.raises(RequestTooLargeError):
        engine.add_request("huge", [7] * 500, SamplingParams(max_tokens=100))
    assert not engine.has_unfinished_requests() and engine.get_stats()["num_waiting"] == 0


def test_duplicate_request_ids_and_unknown_adapters_are_refused(engine: LLMEngine) -> None:
    engine.add_request("dup", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="LoRA"):
        engine.add_request("lora", PROMPT, SamplingParams(max_tokens=2), lora=LoRARef("sql", "/nowhere", "1"))
    _drain(engine)


def test_stop_token_ids_end_the_completion_with_that_reason(engine: LLMEngine) -> None:
    engine.add_request("probe", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first = _drain(engine)[-1].outputs[0].token_ids
    engine.add_request(
        "stop", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[first[1]])
    )
    c = _drain(engine)[-1].outputs[0]
    assert c.token_ids == first[:2] and c.finish_reason == "stop" and c.stop_reason == first[1]


def test_parallel_sampling_returns_n_completions_with_distinct_seeded_samples(engine: LLMEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    engine.add_request("n3", PROMPT, params)
    final = _drain(engine)[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3
    # Same seed, other requests in the batch: same samples.
    engine.add_request("noise", PROMPT[:4], SamplingParams(temperature=1.0, max_tokens=8))
    engine.add_request("n3-again", PROMPT, params)
    again = {o.request_id: o for o in _drain(engine) if o.finished}["n3-again"]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]


def test_stats_report_scheduler_and_request_counters(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    for key in (
        "num_running",
        "num_waiting",
        "num_free_blocks",
        "num_total_blocks",
        "kv_cache_usage",
        "prefix_cache_hit_rate",
        "num_preemptions",
        "num_requests",
        "num_generated_tokens",
    ):
        assert key in stats
    assert stats["num_total_blocks"] == 32


def test_llm_generate_returns_outputs_in_prompt_order(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = ["import os", "def f(x):\n    return", "class A:"]
    together = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert together[0].num_prompt_tokens == len(llm.tokenizer.encode("import os"))


def test_llm_chat_applies_the_template_once(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_blocks=64)
    (out,) = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_tokens=3))
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    expected = llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.num_prompt_tokens == len(expected) and expected.count(0) == 1  # a single <|begin_of_text|>


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"priority": "high"}, "priority must be an integer"),
        ({"priority": True}, "priority must be an integer"),
        ({"tenant": 5}, "tenant and cache_salt must be strings"),
        ({"cache_salt": 7}, "tenant and cache_salt must be strings"),
    ],
)
def test_wrongly_typed_request_fields_are_refused_before_they_can_break_a_step(
    engine: LLMEngine, fields: dict, message: str
) -> None:
    engine.add_request("fine", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("typed", PROMPT, SamplingParams(max_tokens=2), **fields)
    with pytest.raises(InvalidRequestError, match="request_id must be a non-empty string"):
        engine.add_request("", PROMPT, SamplingParams(max_tokens=2))
    finished = [o for o in _drain(engine) if o.finished]
    assert [o.request_id for o in finished] == ["fine"] and finished[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("configured", "max_num_seqs", "sizes"),
    [
        ((), 20, (1, 2, 4, 8, 16, 20)),  # every decode batch has a graph: 17-20 replay the 20
        ((), 256, (1, 2, 4, *range(8, 257, 8))),
        ((), 3, (1, 2, 3)),
        ((1, 8, 64, 512, 8), 100, (1, 8, 64)),  # configured: taken as given, within max_num_seqs
    ],
)
def test_cuda_graphs_cover_the_decode_batches_the_scheduler_can_form(configured, max_num_seqs, sizes) -> None:
    from engine.engine_setup import graph_batch_sizes

    assert graph_batch_sizes(configured, max_num_seqs) == sizes


@pytest.mark.parametrize(("budget", "max_model_len"), [(2048, 2048), (16, 2048), (2048, 100), (8192, 40)])
def test_the_gpu_warm_up_steps_fit_the_step_budget_and_the_context(budget, max_model_len) -> None:
    from engine.warm_up import warm_up_shapes

    shapes = warm_up_shapes(budget, max_model_len, block_size=16)
    assert ([min(budget, max_model_len)], [min(budget, max_model_len)]) in shapes  # the widest prefill
    for lengths, new in shapes:
        assert max(lengths) <= max_model_len and sum(new) <= budget
        assert all(0 < n <= length for n, length in zip(new, lengths, strict=True))


@pytest.mark.slow
def test_a_new_cpu_engine_has_built_its_kernels_before_its_first_request(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """With an empty kernel cache (a fresh machine), building the engine compiles every C kernel the
    forward uses: none is left for a tenant's first request to wait for."""
    import os
    import subprocess
    import sys

    from kernels import cpu_fused

    if not cpu_fused.available():
        pytest.skip("no C compiler: the CPU forward runs the torch forms")
    code = (
        "import os, sys; from engine.llm import LLM; llm = LLM(sys.argv[1]); "
        "print(llm.engine.warm_up_seconds); print(' '.join(sorted(os.listdir(sys.argv[2]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama_dir), str(tmp_path / "kernels")],
        env={**os.environ, "PAGODA_CACHE_DIR": str(tmp_path)},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, built = done.stdout.strip().splitlines()[-2:]
    assert float(seconds) > 0
    for kernel in ("fused_elementwise", "paged_decode_attention", "paged_prefill_attention"):
        assert any(name.startswith(kernel) and name.endswith(".so") for name in built.split()), built
