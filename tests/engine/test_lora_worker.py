"""Adapters through the Redis worker: `python -m engine.serve --enable-lora` against real Redis."""

from __future__ import annotations

import pytest

from engine.protocol import GenerateRequest, LoRARef, requests_stream
from engine.sampling_params import SamplingParams
from tests.engine import lora_helpers
from tests.engine.lora_helpers import lora_engine, run_to_completion
from tests.engine.test_worker import (
    MODEL,
    PROMPT,
    Workers,
    new_prefix,
    stats_of,
    streamed,
    wait_events,
    wait_for,
)

pytestmark = pytest.mark.slow

adapter_dirs = lora_helpers.adapter_dirs  # the session fixture the LoRA test modules share


def submit(workers: Workers, request_id: str, tenant: str, lora: LoRARef | None) -> None:
    request = GenerateRequest(
        request_id=request_id,
        model=MODEL,
        prompt_token_ids=PROMPT,
        sampling_params={"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
        tenant=tenant,
        lora=lora,
    )
    workers.client.xadd(requests_stream(workers.prefix, MODEL), request.encode())


def test_a_lora_worker_serves_each_tenants_adapter_and_reports_a_broken_one(
    tiny_llama_dir, adapter_dirs, tmp_path
):
    direct = lora_engine(tiny_llama_dir)
    for name in ("r8", "r16"):
        direct.add_request(name, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           tenant="t", lora=LoRARef(name, str(adapter_dirs[name]), "1"))  # fmt: skip
    expected = {name: out.outputs[0].token_ids for name, out in run_to_completion(direct).items()}
    workers = Workers(tiny_llama_dir, new_prefix(), tmp_path)
    try:
        workers.start("lora", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
        workers.wait_ready("lora")
        # One adapter name, two tenants, two different sets of weights.
        submit(workers, "a", "tenant-a", LoRARef("support", str(adapter_dirs["r8"]), "1"))
        submit(workers, "b", "tenant-b", LoRARef("support", str(adapter_dirs["r16"]), "1"))
        submit(workers, "broken", "tenant-a", LoRARef("gone", str(tmp_path / "nowhere"), "1"))

        a, b = (wait_events(workers.client, workers.prefix, rid) for rid in ("a", "b"))
        broken = wait_events(workers.client, workers.prefix, "broken")

        assert streamed(a)[1] == expected["r8"] and a[-1].type == "finished"
        assert streamed(b)[1] == expected["r16"] and b[-1].type == "finished"
        assert [(e.type, e.code) for e in broken] == [("error", "lora_load_failed")]
        assert broken[0].message == f"{tmp_path / 'nowhere'}: missing adapter_config.json"

        def both_loaded():
            stats = stats_of(workers.client, workers.prefix, "lora")
            return stats is not None and sorted(stats.loras_loaded) == [
                "tenant-a/support",
                "tenant-b/support",
            ]

        wait_for(both_loaded, what="the heartbeat to list both adapters")
    finally:
        workers.close()


def test_a_worker_started_without_lora_refuses_adapter_requests(tiny_llama_dir, adapter_dirs, tmp_path):
    workers = Workers(tiny_llama_dir, new_prefix(), tmp_path)
    try:
        workers.start("plain")
        workers.wait_ready("plain")
        submit(workers, "x", "tenant-a", LoRARef("support", str(adapter_dirs["r8"]), "1"))

        events = wait_events(workers.client, workers.prefix, "x")

        assert [(e.type, e.code, e.message) for e in events] == [
            ("error", "lora_unavailable", "this engine replica does not serve LoRA adapters")
        ]
    finally:
        workers.close()
