"""Random workloads through the real engine: arrivals spread over steps, tenants, priorities, cache
salts, parallel samples, a tight pool and aborts. Every request that is not aborted must end with
exactly the tokens it gets when it runs alone, be reported finished once, and leave no block held."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import _prompts


def _engine(model_dir: Path, num_blocks: int, budget: int, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        )
    )


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLMEngine:
    # Three slots: a request may run two sequences (max_seqs_per_request), as the workload's do.
    return _engine(tiny_llama_dir, num_blocks=64, budget=512, max_num_seqs=3)


def _alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    engine.add_request("alone", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return [c.token_ids for c in final.outputs]


def test_a_random_workload_gives_every_request_its_solo_tokens(
    tiny_llama_dir: Path, reference: LLMEngine
) -> None:
    seed = 0
    rng = random.Random(seed)
    shared = _prompts([20], seed=100 + seed)[0]
    requests = []
    for i in range(8):
        tail = _prompts([rng.randint(1, 20)], seed=1000 * seed + i)[0]
        prompt = shared[: rng.choice([0, 16, 20])] + tail
        params = SamplingParams(
            n=rng.choice([1, 1, 2]), temperature=0.0, max_tokens=rng.randint(4, 14), ignore_eos=True
        )
        tenant = rng.choice("AB")
        requests.append((f"r{i}", prompt, params, tenant, rng.randint(0, 1), rng.choice([None, tenant])))
    arrivals = sorted(rng.sample(range(12), len(requests)))
    # Two requests are aborted a few steps after they arrive: waiting, mid-prefill or decoding.
    aborted = {requests[i][0]: arrivals[i] + rng.randint(0, 4) for i in rng.sample(range(len(requests)), 2)}

    engine = _engine(
        tiny_llama_dir, num_blocks=rng.randint(5, 6), budget=rng.choice([8, 16, 32]), max_num_seqs=4
    )
    finals: dict[str, object] = {}
    pending = list(zip(arrivals, requests, strict=True))
    for step in range(300):
        while pending and pending[0][0] <= step:
            _, (request_id, prompt, params, tenant, priority, salt) = pending.pop(0)
            engine.add_request(request_id, prompt, params, tenant=tenant, priority=priority, cache_salt=salt)
        for request_id, at in aborted.items():
            if at == step:
                engine.abort_request(request_id)
        for out in engine.step():
            assert out.request_id not in finals, f"{out.request_id} reported after it finished"
            if out.finished:
                finals[out.request_id] = out
        if not pending and not engine.has_unfinished_requests():
            break

    assert set(finals) == {r[0] for r in requests}
    for request_id, prompt, params, *_ in requests:
        out = finals[request_id]
        assert out.num_cached_tokens < len(prompt) and out.num_cached_tokens % 16 == 0
        reasons = {c.finish_reason for c in out.outputs}
        if "abort" in reasons:
            assert request_id in aborted
            continue
        assert reasons == {"length"}
        assert [c.token_ids for c in out.outputs] == _alone(reference, prompt, params), request_id
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and all(b.ref_count == 0 for b in bm.blocks)
    # The workload really exercised the paths that could mix requests up.
    assert engine.scheduler.num_preemptions > 0 and bm.prefix_cache_stats()["hits"] > 0
    assert all(finals[r].outputs[0].finish_reason == "abort" for r in aborted)
