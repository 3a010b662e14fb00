"""Several adapters and the base model in one batch, through a limited number of device slots."""

from __future__ import annotations

import pytest

from engine.protocol import LoRARef
from engine.sampling_params import SamplingParams
from tests.engine import lora_helpers
from tests.engine.lora_helpers import lora_engine, prompts, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

adapter_dirs = lora_helpers.adapter_dirs  # the session fixture the LoRA test modules share


def ref(adapter_dirs, name: str | None, version: str = "1") -> LoRARef | None:
    return None if name is None else LoRARef(name, str(adapter_dirs[name]), version)


def record_steps(engine) -> list[set[int]]:
    """The set of lora ids (0 = base) in each step the runner executes."""
    steps: list[set[int]] = []
    runner = engine.runner
    original = runner.run

    def run(scheduler_output, profile=None, between_layers=None):
        steps.append({item.seq.lora_id for item in scheduler_output.scheduled})
        return original(scheduler_output, profile, between_layers)

    runner.run = run
    return steps


def alone(tiny_llama_dir, adapter_dirs, prompt, name) -> list[int]:
    engine = lora_engine(tiny_llama_dir, enable_prefix_caching=False)
    engine.add_request("alone", prompt, GREEDY, tenant="acme", lora=ref(adapter_dirs, name))
    return run_to_completion(engine)["alone"].outputs[0].token_ids


@pytest.fixture(scope="module")
def workload(tiny_llama_dir, adapter_dirs):
    """Eight requests over three adapters and the base model, with what each gives when run alone."""
    names = ["r8", "r16", "qv4", None, "r16", "r8", None, "qv4"]
    batch = list(zip(names, prompts([7, 19, 33, 12, 40, 3, 25, 17], seed=3), strict=True))
    return [(name, prompt, alone(tiny_llama_dir, adapter_dirs, prompt, name)) for name, prompt in batch]


def run_workload(engine, adapter_dirs, workload) -> list[list[int]]:
    """Every request of the workload at once (tenant acme, each on its adapter); their tokens."""
    for i, (name, prompt, _) in enumerate(workload):
        engine.add_request(f"w{i}", prompt, GREEDY, tenant="acme", lora=ref(adapter_dirs, name))
    final = run_to_completion(engine)
    return [final[f"w{i}"].outputs[0].token_ids for i in range(len(workload))]


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_request_its_solo_tokens(
    tiny_llama_dir, adapter_dirs, workload
):
    engine = lora_engine(tiny_llama_dir, max_loras=4)
    steps = record_steps(engine)

    tokens = run_workload(engine, adapter_dirs, workload)

    assert tokens == [solo for _, _, solo in workload]
    assert max(len(s) for s in steps) == 4  # some step really held all three adapters and the base


def test_two_slots_serve_three_adapters_in_flight_loading_and_evicting_and_starving_none(
    tiny_llama_dir, adapter_dirs, workload
):
    engine = lora_engine(tiny_llama_dir, max_loras=2, max_num_seqs=8)
    steps = record_steps(engine)

    tokens = run_workload(engine, adapter_dirs, workload)

    assert tokens == [solo for _, _, solo in workload]
    assert all(len(s - {0}) <= 2 for s in steps)
    assert len(set().union(*steps) - {0}) == 3
    stats = engine.get_stats()
    assert stats["num_lora_slot_loads"] >= 3 and stats["num_lora_slot_evictions"] >= 1
    assert stats["num_lora_disk_loads"] == 3 and stats["num_requests"] == 0


def test_the_same_prompt_under_two_adapters_shares_no_cached_blocks(tiny_llama_dir, adapter_dirs):
    engine = lora_engine(tiny_llama_dir)
    prompt = prompts([50], seed=11)[0]  # three full blocks of 16 and a partial one
    served = []
    for i, name in enumerate(["r8", "r16", "r8", None]):
        engine.add_request(f"p{i}", prompt, GREEDY, tenant="acme", lora=ref(adapter_dirs, name))
        served.append(run_to_completion(engine)[f"p{i}"])

    assert [out.num_cached_tokens for out in served] == [0, 0, 48, 0]
    assert served[0].outputs[0].token_ids == served[2].outputs[0].token_ids
    assert served[0].outputs[0].token_ids != served[1].outputs[0].token_ids


def test_a_new_version_of_an_adapter_reuses_nothing_cached_under_the_old_one(tiny_llama_dir, adapter_dirs):
    engine = lora_engine(tiny_llama_dir)
    prompt = prompts([40], seed=12)[0]
    engine.add_request(
        "v1", prompt, GREEDY, tenant="acme", lora=LoRARef("mine", str(adapter_dirs["r8"]), "1")
    )
    run_to_completion(engine)
    # Re-uploaded under the same name: other weights, a new version.
    engine.add_request(
        "v2", prompt, GREEDY, tenant="acme", lora=LoRARef("mine", str(adapter_dirs["r16"]), "2")
    )

    out = run_to_completion(engine)["v2"]

    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == alone(tiny_llama_dir, adapter_dirs, prompt, "r16")


def test_one_adapter_name_in_two_tenants_resolves_to_each_tenants_own_weights(tiny_llama_dir, adapter_dirs):
    engine = lora_engine(tiny_llama_dir)
    prompt = prompts([20], seed=13)[0]
    engine.add_request(
        "a", prompt, GREEDY, tenant="tenant-a", lora=LoRARef("support", str(adapter_dirs["r8"]), "1")
    )
    engine.add_request(
        "b", prompt, GREEDY, tenant="tenant-b", lora=LoRARef("support", str(adapter_dirs["r16"]), "1")
    )

    final = run_to_completion(engine)

    assert final["a"].outputs[0].token_ids == alone(tiny_llama_dir, adapter_dirs, prompt, "r8")
    assert final["b"].outputs[0].token_ids == alone(tiny_llama_dir, adapter_dirs, prompt, "r16")
    assert sorted(engine.get_stats()["loras_loaded"]) == ["tenant-a/support", "tenant-b/support"]


def test_the_host_cache_drops_idle_adapters_but_keeps_those_requests_wait_for(tiny_llama_dir, adapter_dirs):
    engine = lora_engine(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    prompt = prompts([9], seed=14)[0]
    # Three adapters queued at once: all pinned in host memory past max_cpu_loras until they finish.
    for name in ["r8", "r16", "qv4"]:
        engine.add_request(name, prompt, GREEDY, tenant="acme", lora=ref(adapter_dirs, name))
    assert engine.get_stats()["num_loras_cached"] == 3

    final = run_to_completion(engine)

    assert final["r16"].outputs[0].token_ids == alone(tiny_llama_dir, adapter_dirs, prompt, "r16")
    stats = engine.get_stats()
    assert stats["num_loras_cached"] == 1 and stats["num_lora_disk_loads"] == 3
    # An aborted request releases its adapter too: the next one evicts it from the host cache.
    engine.add_request("gone", prompt, GREEDY, tenant="acme", lora=ref(adapter_dirs, "r8"))
    engine.step()
    engine.abort_request("gone")
    run_to_completion(engine)
    engine.add_request("next", prompt, GREEDY, tenant="acme", lora=ref(adapter_dirs, "r16"))
    assert engine.get_stats()["num_loras_cached"] == 1
    run_to_completion(engine)


def test_a_lora_request_continued_after_a_failover_keeps_its_adapter(tiny_llama_dir, adapter_dirs):
    from engine.resume import Resume

    engine = lora_engine(tiny_llama_dir)
    [prompt] = prompts([24], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    adapter = ref(adapter_dirs, "r8")
    engine.add_request("whole", prompt, params, tenant="acme", lora=adapter)
    engine.add_request("base", prompt, params, tenant="acme")
    finals = run_to_completion(engine)
    whole = finals["whole"].outputs[0].token_ids
    assert whole != finals["base"].outputs[0].token_ids  # the adapter changes the output

    # A fresh replica takes it over: the adapter is loaded there as for any request.
    taker = lora_engine(tiny_llama_dir)
    taker.add_request("whole", prompt, params, tenant="acme", lora=adapter, resume=Resume(((*whole[:6],),)))
    continued = run_to_completion(taker)["whole"].outputs[0]

    assert continued.token_ids == whole
    assert taker.lora_manager is not None and taker.lora_manager.loaded_names() != []
