"""What a structured output request may cost the other tenants: masks filled for the whole batch at
once, grammars too costly to enforce refused at compile time, compiles bounded in time, per replica
and per tenant, cancelled with their requests, a cache per tenant bounded by bytes, and a failed
forward's detail kept from the other requests of its batch.

The model is tiny but has SmolLM2's tokenizer (49152 tokens): grammar costs grow with the
vocabulary, and only a real one shows them (`.{0,4000}` takes about 2 s to compile and milliseconds
per mask)."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import time
from pathlib import Path

import pytest

from engine.config import StructuredOutputConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured_output.manager import StructuredOutputManager
from tests.helpers import wait_until

SLOW = ".{0,%d}"  # distinct widths: distinct grammars, each about as slow to compile and to enforce


@pytest.fixture(scope="module")
def big_vocab_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-big-vocab")
    source = json.loads((smollm2_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=source["vocab_size"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        max_position_embeddings=2048,
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


def _engine(model_dir: Path, **grammar: object) -> LLMEngine:
    llm = LLM(str(model_dir), max_num_seqs=64, structured_output=StructuredOutputConfig(**grammar))
    return llm.engine


def _run(engine: LLMEngine, until, *, timeout: float = 120.0) -> dict[str, object]:
    """Step until `until(finished)` holds; the finished outputs by request id."""
    finished: dict[str, object] = {}
    deadline = time.monotonic() + timeout
    while not until(finished):
        assert time.monotonic() < deadline, f"not done in {timeout} s: {sorted(finished)}"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_the_masks_of_a_batch_are_filled_in_one_batched_call(big_vocab_dir: Path) -> None:
    engine = _engine(big_vocab_dir)
    manager = engine.grammars.manager
    calls: list[int] = []
    fill = manager._batch.batch_fill_next_token_bitmask

    def counted(matchers, bitmask, indices=None, debug_print=False):
        calls.append(len(matchers))
        return fill(matchers, bitmask, indices, debug_print)

    manager._batch.batch_fill_next_token_bitmask = counted
    spec = {"regex": "[a-z]{8}"}
    engine.add_request("c", [5, 6], SamplingParams(n=4, max_tokens=8, seed=1, structured_outputs=spec))
    engine.add_request("free", [7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    outs = _run(engine, lambda f: len(f) == 2)
    # At most one call per step, covering every constrained sequence that step samples (all
    # four while they run together): never one call per sequence.
    assert len(calls) <= engine.num_steps and max(calls) == 4
    assert sum(calls) == sum(len(c.token_ids) for c in outs["c"].outputs)
    assert all(len(c.text) == 8 for c in outs["c"].outputs)


def test_a_grammar_too_costly_to_enforce_is_refused_and_does_not_slow_the_others(big_vocab_dir: Path) -> None:
    engine = _engine(big_vocab_dir)
    victim = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def victim_step_seconds(request_id: str) -> float:
        engine.add_request(request_id, [5, 6, 7], victim)
        times: list[float] = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        return statistics.median(times[2:])

    victim_step_seconds("warm-up")
    baseline = victim_step_seconds("victim-alone")
    attack = SamplingParams(n=8, max_tokens=200, ignore_eos=True, structured_outputs={"regex": SLOW % 4000})
    generated = engine.num_generated_tokens
    engine.add_request("attacker", [9, 10], attack)
    # The attacker's grammar is compiled (or refused) before the victim starts.
    outs = _run(engine, lambda f: "attacker" in f or engine.num_generated_tokens > generated)
    under_attack = victim_step_seconds("victim-attacked")
    outs.update(_run(engine, lambda f: not engine.has_unfinished_requests()))
    assert outs["attacker"].error_code == "grammar_too_costly"
    # Its costliest mask is past max_mask_ms here; on a faster CPU its eight masks per step are past
    # max_request_mask_ms.
    assert "mask_ms" in outs["attacker"].error
    assert outs["attacker"].outputs[0].token_ids == []
    assert under_attack <= 3 * baseline, (under_attack, baseline)
    # Refused from the cache at once the next time, with its code.
    with pytest.raises(Exception, match="too costly") as refused:
        engine.add_request("again", [9, 10], attack)
    assert refused.value.code == "grammar_too_costly"


def test_a_requests_masks_times_its_n_are_bounded(big_vocab_dir: Path) -> None:
    """A grammar each of whose masks is affordable is refused for an n whose masks together would
    take more than max_request_mask_ms per step, whether its compile was cached or not."""
    engine = _engine(big_vocab_dir, max_mask_ms=10_000)
    spec = {"regex": "[a-z]{0,200}", "disable_any_whitespace": True}
    engine.add_request("one", [5, 6], SamplingParams(max_tokens=4, structured_outputs=spec))
    outs = _run(engine, lambda f: "one" in f)
    assert outs["one"].error is None
    job = engine.grammars.manager.grammar(spec)
    engine.grammars.manager.release(job)
    assert job.mask_ms > 0
    # This engine allows two and a half such masks per step: n=2 runs, n=3 is refused at once
    # from the cache, and on a fresh spec (compiled while it waits) it ends with the same code.
    engine.grammars.config.max_request_mask_ms = 2.5 * job.mask_ms
    engine.add_request("two", [5, 6], SamplingParams(n=2, max_tokens=4, structured_outputs=spec))
    with pytest.raises(Exception, match="max_request_mask_ms") as refused:
        engine.add_request("three", [5, 6], SamplingParams(n=3, max_tokens=4, structured_outputs=spec))
    assert refused.value.code == "grammar_too_costly"
    fresh = {"regex": "[a-z]{0,201}", "disable_any_whitespace": True}
    engine.grammars.config.max_request_mask_ms = 1e-6
    engine.add_request("fresh", [5, 6], SamplingParams(n=3, max_tokens=4, structured_outputs=fresh))
    outs = _run(engine, lambda f: {"two", "fresh"} <= f.keys())
    assert outs["two"].error is None and len(outs["two"].outputs) == 2
    assert outs["fresh"].error_code == "grammar_too_costly"
    assert "max_request_mask_ms" in outs["fresh"].error


def test_a_compile_past_its_timeout_ends_the_request_and_frees_its_slot(big_vocab_dir: Path) -> None:
    engine = _engine(big_vocab_dir, compile_timeout_s=0.3, max_compiles=1)
    engine.add_request("slow", [5, 6], SamplingParams(structured_outputs={"regex": SLOW % 3999}))
    outs = _run(engine, lambda f: "slow" in f)
    assert outs["slow"].error_code == "grammar_compile_timeout"
    assert "compile_timeout_s" in outs["slow"].error
    assert engine.grammars.manager.pool.num_timeouts == 1
    # The killed compile process is replaced: the one slot compiles the next grammar.
    engine.add_request("next", [5, 6], SamplingParams(max_tokens=6, structured_outputs={"regex": "[ab]{3}"}))
    outs = _run(engine, lambda f: "next" in f)
    assert outs["next"].error is None and len(outs["next"].outputs[0].text) == 3


def _compile_seconds(engine: LLMEngine, request_id: str, spec: dict, tenant: str) -> float:
    """Wall time from adding a request to its grammar being ready (its first step)."""
    started = time.perf_counter()
    engine.add_request(
        request_id, [5, 6], SamplingParams(max_tokens=1, structured_outputs=spec), tenant=tenant
    )
    _run(engine, lambda f: request_id in f)
    return time.perf_counter() - started


def test_an_aborted_requests_compile_does_not_hold_the_pool(big_vocab_dir: Path) -> None:
    engine = _engine(big_vocab_dir, max_compiles=1, max_mask_ms=10_000)
    pool = engine.grammars.manager.pool
    slow_alone = _compile_seconds(engine, "baseline", {"regex": SLOW % 3990}, "a")
    engine.add_request("gone", [5, 6], SamplingParams(structured_outputs={"regex": SLOW % 3991}), tenant="a")
    _run(engine, lambda f: engine.grammars.waiting["gone"].job.started, timeout=60)
    engine.abort_request("gone")
    _run(engine, lambda f: "gone" in f)
    # The one slot is free at once: another tenant's grammar does not wait for the aborted compile.
    other = _compile_seconds(engine, "other", {"regex": "[ab]{3}"}, "b")
    assert other < slow_alone / 2, (other, slow_alone)
    assert pool.num_cancelled >= 1


def test_a_tenants_slow_grammars_do_not_hold_another_tenants_compile(big_vocab_dir: Path) -> None:
    engine = _engine(big_vocab_dir, max_compiles=2, max_compiles_per_tenant=1, max_mask_ms=10_000)
    slow_alone = _compile_seconds(engine, "baseline", {"regex": SLOW % 3980}, "attacker")
    for i in range(4):
        spec = {"regex": SLOW % (3981 + i)}
        engine.add_request(
            f"a{i}", [5, 6], SamplingParams(max_tokens=1, structured_outputs=spec), tenant="attacker"
        )
    victim = _compile_seconds(engine, "victim", {"regex": "[ab]{3}"}, "victim")
    assert victim < slow_alone / 2, (victim, slow_alone)
    for i in range(4):
        engine.abort_request(f"a{i}")
    _run(engine, lambda f: not engine.has_unfinished_requests())


def test_a_requests_deadline_applies_while_it_waits_for_its_grammar(big_vocab_dir: Path) -> None:
    engine = _engine(big_vocab_dir, max_compiles=1, max_mask_ms=10_000)
    pool = engine.grammars.manager.pool
    deadline = time.time() + 0.3
    for name, width in (("started", 3970), ("queued", 3971)):  # one tenant: one compile at a time
        spec = {"regex": SLOW % width}
        engine.add_request(
            name, [5, 6, 7], SamplingParams(structured_outputs=spec), tenant="t", deadline=deadline
        )
    outs = _run(engine, lambda f: len(f) == 2)
    # The started compile is billed (its code is not queue_timeout) and killed; the queued one never ran.
    assert outs["started"].error_code == "grammar_compile_timeout"
    assert outs["queued"].error_code == "queue_timeout"
    assert pool.num_cancelled == 2 and pool.num_timeouts == 0
    assert not engine.grammars.waiting


def test_the_grammar_cache_is_per_tenant_and_bounded_by_bytes(big_vocab_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(big_vocab_dir)
    manager = StructuredOutputManager(
        tokenizer,
        vocab_size=len(tokenizer),
        eos_token_ids=[tokenizer.eos_token_id],
        config=StructuredOutputConfig(cache_bytes=2_500_000, max_mask_ms=10_000),
    )
    try:
        spec = {"regex": "[a-z]{0,300}", "disable_any_whitespace": True}
        mine = manager.grammar(spec, tenant="a")
        mine.future.result(timeout=60)
        theirs = manager.grammar(spec, tenant="b")
        assert theirs is not mine  # compiled again for tenant b: no timing tells b what a sent
        assert manager.grammar(spec, tenant="a") is mine
        theirs.future.result(timeout=60)
        size = mine.nbytes
        assert size > 1_000_000  # xgrammar's memory_size_bytes of this grammar, plus its key
        for width in (301, 302, 303):
            job = manager.grammar(
                {"regex": f"[a-z]{{0,{width}}}", "disable_any_whitespace": True}, tenant="a"
            )
            job.future.result(timeout=60)
            assert manager.cache_bytes <= 2_500_000
        assert manager.grammar(spec, tenant="a") is not mine  # evicted, compiled again
    finally:
        manager.shutdown()


def test_a_forward_error_reaches_no_other_request_with_its_detail(big_vocab_dir: Path) -> None:
    engine = _engine(big_vocab_dir)
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=4), tenant="a")
    engine.add_request("b", [7, 8], SamplingParams(max_tokens=4), tenant="b")
    execute = engine.runner.execute

    def failing(inputs):
        raise RuntimeError("tenant a's prompt said: the launch code is 0000")

    engine.runner.execute = failing
    try:
        outs = _run(engine, lambda f: len(f) == 2)
    finally:
        engine.runner.execute = execute
    for out in outs.values():
        assert out.error_code == "engine_error"
        assert "launch code" not in out.error and "RuntimeError" not in out.error


def test_the_mask_cost_probe_is_not_fooled_by_a_loaded_machine(smollm2_dir: Path, monkeypatch) -> None:
    """A loaded machine makes some fills slow (a cold cache, page faults, a busy sibling core): the
    probe times a fill past the budget again and keeps the cheapest, so a well-behaved JSON schema
    passes even when every first timing is inflated, and `.{0,4000}` is refused all the same."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from engine.structured_output import compile_worker
    from engine.structured_output.grammar import build_grammar

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["capital", "population"],
        "additionalProperties": False,
    }
    cheap = compiler.compile_grammar(build_grammar({"json": schema}))
    costly = compiler.compile_grammar(build_grammar({"regex": SLOW % 4000}))

    # Every other reading of the thread's CPU clock jumps by 50 ms: the first timing of each fill
    # is inflated, as on a machine whose other work keeps evicting the matcher's caches.
    real = time.thread_time
    calls = {"n": 0, "skew": 0.0}

    def loaded() -> float:
        calls["n"] += 1
        if calls["n"] % 4 == 2:
            calls["skew"] += 0.050
        return real() + calls["skew"]

    monkeypatch.setattr(compile_worker.time, "thread_time", loaded)
    assert compile_worker.mask_cost_ms(cheap, info, budget_ms=2.0) <= 2.0
    monkeypatch.setattr(compile_worker.time, "thread_time", real)
    assert compile_worker.mask_cost_ms(costly, info, budget_ms=2.0) > 2.0


def _thread_nices(pid: int) -> dict[int, int]:
    import os

    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            nices[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
    return nices


def test_a_slow_compile_goes_on_in_the_background(big_vocab_dir: Path) -> None:
    """A compile still running after BACKGROUND_AFTER_S goes on at compile_nice, so that on busy
    cores the engine's steps come first; the compile process keeps its own priority, so its next
    compile starts at the engine's again. A quick grammar never leaves the foreground."""
    import os

    engine = _engine(big_vocab_dir, max_compiles=1, max_mask_ms=10_000, compile_nice=7)
    pool = engine.grammars.manager.pool
    [slot] = pool._slots
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = min(19, ours + 7)

    _compile_seconds(engine, "quick", {"regex": "[ab]{3}"}, "a")
    pid = slot._process.pid
    assert pool.num_background == 0
    assert set(_thread_nices(pid).values()) == {ours}

    engine.add_request("slow", [5, 6], SamplingParams(structured_outputs={"regex": SLOW % 3950}), tenant="b")
    wait_until(lambda: lowered in _thread_nices(pid).values(), timeout=60, what="the compile thread niced")
    assert _thread_nices(pid)[pid] == ours  # the process's main thread keeps its priority
    _run(engine, lambda f: "slow" in f)
    assert pool.num_background == 1

    _compile_seconds(engine, "after", {"regex": "[cd]{4}"}, "a")
    assert slot._process.pid == pid  # the same process: nothing to replace
    assert set(_thread_nices(pid).values()) == {ours}
    assert pool.num_background == 1


def test_compile_nice_is_checked() -> None:
    with pytest.raises(Exception, match="compile_nice"):
        StructuredOutputConfig(compile_nice=20)
    with pytest.raises(Exception, match="compile_nice"):
        StructuredOutputConfig(compile_nice=-1)


def test_a_compile_no_request_waits_for_any_more_is_never_started(big_vocab_dir: Path) -> None:
    """A queued job whose requests' deadlines have all passed is dropped when a slot comes to it,
    never started (a started compile is billed, and costs a process when killed); a request that
    asks for the same grammar afterwards gets a compile of its own."""
    engine = _engine(big_vocab_dir, max_compiles=1, max_mask_ms=10_000)
    manager = engine.grammars.manager
    pool = manager.pool
    busy = manager.grammar({"regex": SLOW % 3940}, tenant="t")
    wait_until(lambda: busy.started, timeout=60, what="the busy compile to start")
    late = manager.grammar({"regex": "[ab]{3}"}, tenant="t", deadline=time.time() + 0.2)
    # A later request for the same grammar, until a later deadline: the job waits for it too.
    assert manager.grammar({"regex": "[ab]{3}"}, tenant="t", deadline=time.time() + 0.4) is late
    wait_until(lambda: time.time() > late.deadline, timeout=60, what="the late job's deadline")
    manager.release(busy)  # the slot is free: it comes to the late job
    wait_until(lambda: late.dropped, timeout=60, what="the late job dropped")
    assert not late.started and not late.future.done()
    assert pool.num_expired == 1
    again = manager.grammar({"regex": "[ab]{3}"}, tenant="t")
    assert again is not late
    assert again.future.result(timeout=60) is not None
    for job in (late, late, again):
        manager.release(job)
