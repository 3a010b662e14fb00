"""Parity with transformers + PEFT: a request under adapter X gets the logits and greedy tokens that
PEFT computes for X on the same base weights.

The oracle is one PEFT forward over each sequence's final tokens (prompt + generated); causal
attention makes its logits at position p depend only on tokens 0..p, which is what the engine saw
when it sampled the token after p.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.protocol import LoRARef
from engine.sampling_params import SamplingParams
from tests.engine import lora_helpers
from tests.engine.lora_helpers import lora_engine, prompts, reference_model, run_to_completion

ATOL = 1e-4  # float32 end to end

adapter_dirs = lora_helpers.adapter_dirs  # the session fixture the LoRA test modules share


class SampledLogits:
    """Every logits row the engine sampled from, with the sequence and position it belongs to."""

    def __init__(self, engine: LLMEngine) -> None:
        runner = engine.runner
        self.rows: list[tuple[object, int, torch.Tensor]] = []
        original = runner.execute

        def execute(inputs):
            logits = original(inputs)
            for item, row in zip(inputs.sampled, logits, strict=True):
                self.rows.append((item.seq, item.start_pos + item.num_new_tokens - 1, row.float().cpu()))
            return logits

        runner.execute = execute

    def check_against(self, model_dir: Path, adapter_of: dict[int, Path | None]) -> int:
        """Assert every sampled row matches the reference; return how many rows were compared."""
        oracle: dict[int, torch.Tensor] = {}
        for seq, pos, row in self.rows:
            if seq.seq_id not in oracle:
                model = reference_model(model_dir, adapter_of[seq.seq_id])
                with torch.no_grad():
                    oracle[seq.seq_id] = model(torch.tensor([seq.token_ids])).logits[0].float()
            torch.testing.assert_close(row, oracle[seq.seq_id][pos], atol=ATOL, rtol=0)
            # Greedy: the token the engine chose is the reference's argmax at that position.
            assert seq.token_ids[pos + 1] == int(oracle[seq.seq_id][pos].argmax())
        return len(self.rows)


@pytest.mark.parametrize("name", ["r8", "r16", "qv4"])
def test_greedy_tokens_and_logits_under_an_adapter_match_peft(tiny_llama_dir, adapter_dirs, name):
    engine = lora_engine(tiny_llama_dir)
    recorder = SampledLogits(engine)
    adapter = adapter_dirs[name]
    ids = []
    for i, prompt in enumerate(prompts([5, 21, 40], seed=len(name))):
        engine.add_request(f"{name}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           tenant="acme", lora=LoRARef(name, str(adapter), "1"))  # fmt: skip
        ids.append(f"{name}-{i}")

    final = run_to_completion(engine)

    assert sorted(final) == sorted(ids) and all(len(final[i].outputs[0].token_ids) == 12 for i in ids)
    seqs = {seq.seq_id for seq, _, _ in recorder.rows}
    assert recorder.check_against(tiny_llama_dir, dict.fromkeys(seqs, adapter)) == 3 * 12


def test_the_adapter_changes_the_output_and_the_base_model_is_untouched(tiny_llama_dir, adapter_dirs):
    engine = lora_engine(tiny_llama_dir)
    recorder = SampledLogits(engine)
    prompt = prompts([30], seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("base", prompt, params, tenant="acme")
    engine.add_request(
        "tuned", prompt, params, tenant="acme", lora=LoRARef("r8", str(adapter_dirs["r8"]), "1")
    )

    final = run_to_completion(engine)

    assert final["base"].outputs[0].token_ids != final["tuned"].outputs[0].token_ids
    adapter_of = {seq.seq_id: adapter_dirs["r8"] if seq.lora_id else None for seq, _, _ in recorder.rows}
    assert recorder.check_against(tiny_llama_dir, adapter_of) == 32


def test_the_triton_kernels_serve_the_same_tokens_as_the_torch_path(tiny_llama_dir, adapter_dirs):
    # Runs the kernels under TRITON_INTERPRET=1 on CPU (and natively on a GPU): the CUDA code path.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    batch = [("r8", 9), ("r16", 14), (None, 6)]
    results = []
    for use_kernels in (False, True):
        engine = lora_engine(tiny_llama_dir)
        manager = engine.lora_manager
        assert manager is not None
        manager.set_kernels(use_kernels)
        recorder = SampledLogits(engine)
        for i, (name, n) in enumerate(batch):
            lora = LoRARef(name, str(adapter_dirs[name]), "1") if name else None
            engine.add_request(f"k{i}", prompts([n], seed=i)[0], params, tenant="acme", lora=lora)
        final = run_to_completion(engine)
        results.append({rid: out.outputs[0].token_ids for rid, out in final.items()})
        adapter_of = {seq.seq_id: adapter_dirs[n] if (n := batch[int(seq.request_id[1:])][0]) else None
                      for seq, _, _ in recorder.rows}  # fmt: skip
        assert recorder.check_against(tiny_llama_dir, adapter_of) == 3 * 4

    assert results[0] == results[1]


@pytest.mark.gpu
def test_on_cuda_a_mixed_batch_matches_peft_through_the_kernels(tiny_llama_dir, adapter_dirs):
    engine = lora_engine(tiny_llama_dir, device="cuda")
    assert engine.lora_manager is not None and engine.lora_manager.use_kernels
    recorder = SampledLogits(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batch = ["r8", "r16", "qv4", None]
    for i, (name, prompt) in enumerate(zip(batch, prompts([9, 30, 17, 24], seed=21), strict=True)):
        lora = LoRARef(name, str(adapter_dirs[name]), "1") if name else None
        engine.add_request(f"g{i}", prompt, params, tenant="acme", lora=lora)

    final = run_to_completion(engine)

    assert all(len(final[f"g{i}"].outputs[0].token_ids) == 12 for i in range(4))
    adapter_of = {
        seq.seq_id: adapter_dirs[n] if (n := batch[int(seq.request_id[1:])]) else None
        for seq, _, _ in recorder.rows
    }
    assert recorder.check_against(tiny_llama_dir, adapter_of) == 4 * 12
