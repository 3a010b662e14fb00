"""Decode steps on CPU in float32 run each decoder layer as one C call (kernels.cpu_decode_layer,
chosen in LlamaForCausalLM._make_decode_layers): the engine's outputs are those of the
layer-by-layer path, steps wider than the kernel takes keep that path, and so do models the kernel
does not compute."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.models import llama
from engine.protocol import LoRARef
from engine.sampling_params import SamplingParams
from kernels import cpu_decode_layer
from tests.engine import lora_helpers
from tests.engine.lora_helpers import lora_engine, prompts, run_to_completion

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="no C compiler for the CPU kernels")
adapter_dirs = lora_helpers.adapter_dirs  # the session fixture the LoRA test modules share

_FORWARD = cpu_decode_layer.DecodeLayers.forward
PROMPTS = [[5, 9, 33, 70, 12, 8, 41], [100, 3, 7] * 9, [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74]]


def _run(model_dir, monkeypatch, enabled: bool):
    monkeypatch.setenv("PAGODA_CPU_DECODE_LAYER", "1" if enabled else "0")
    calls = []

    def counted(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return _FORWARD(self, x, *args, **kwargs)

    monkeypatch.setattr(cpu_decode_layer.DecodeLayers, "forward", counted)
    llm = LLM(str(model_dir), num_blocks=128, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    # One sequence alone, three together, then ten (the wide products past 8 rows, with AVX-512).
    wide = [[(t + i) % 1000 for t in PROMPTS[i % 3]] for i in range(10)]
    outs = llm.generate(PROMPTS[:1], params) + llm.generate(PROMPTS, params) + llm.generate(wide, params)
    return outs, calls, llm.engine.runner.model


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])  # Qwen2: a q|k|v bias
def test_greedy_tokens_and_logprobs_are_those_of_the_layer_path(model, request, monkeypatch):
    model_dir = request.getfixturevalue(model)
    slow, slow_calls, _ = _run(model_dir, monkeypatch, enabled=False)
    fast, fast_calls, fast_model = _run(model_dir, monkeypatch, enabled=True)

    assert slow_calls == []
    assert fast_model._decode_layers is not None
    # Steps of 1 and 3 rows took the one-call layers, and those of 10 where the kernel takes them.
    assert {1, 3} <= set(fast_calls) and max(fast_calls) <= cpu_decode_layer.max_rows()
    assert (10 in fast_calls) == (cpu_decode_layer.max_rows() >= 10)
    for a, b in zip(slow, fast, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
            assert [t for t, _ in la.top_logprobs] == [t for t, _ in lb.top_logprobs]


def test_steps_wider_than_the_kernel_takes_keep_the_layer_path(tiny_llama_dir, monkeypatch):
    slow, _, _ = _run(tiny_llama_dir, monkeypatch, enabled=False)
    monkeypatch.setattr(cpu_decode_layer, "max_rows", lambda dtype=None: 4)
    fast, fast_calls, _ = _run(tiny_llama_dir, monkeypatch, enabled=True)
    assert {1, 3} <= set(fast_calls) and max(fast_calls) == 3  # the steps of 10 rows went layer by layer
    for a, b in zip(slow, fast, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_gemma2_dir", "tiny_mixtral_dir", "tiny_phi3_dir"])
def test_layers_the_kernel_does_not_compute_keep_the_layer_path(model, request, monkeypatch):
    # Qwen3: head norms; Gemma 2: windows, soft caps and its norms; Mixtral: experts; Phi-3: a
    # partial rotary embedding.
    outs, calls, llm_model = _run(request.getfixturevalue(model), monkeypatch, enabled=True)
    assert llm_model._decode_layers is None
    assert calls == []
    assert len(outs) == 14 and all(len(o.outputs[0].token_ids) == 20 for o in outs)


def test_prompt_chunks_beside_decodes_take_the_one_call_layers(tiny_llama_dir, monkeypatch):
    """A step that computes a few prompt tokens beside decodes (chunked prefill, a narrow step
    budget) runs as one C call a layer, each prompt row a decode over the keys up to its own:
    tokens, logprobs and the prompt's logprobs are the layer path's."""
    mixed: list[list[int]] = []  # the query lengths of each step with prompt rows that took the kernel
    real = llama._rows_as_decodes

    def counted(metadata):
        if metadata.max_query_len > 1:
            mixed.append(list(metadata.query_lens_cpu))
        return real(metadata)

    monkeypatch.setattr(llama, "_rows_as_decodes", counted)
    batch = [PROMPTS[0], [(7 * i + 3) % 900 for i in range(37)]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    ]

    def run(enabled: bool):
        monkeypatch.setenv("PAGODA_CPU_DECODE_LAYER", "1" if enabled else "0")
        llm = LLM(str(tiny_llama_dir), num_blocks=128, max_num_seqs=4, max_num_batched_tokens=8)
        return llm.generate(batch, params)

    slow = run(enabled=False)
    assert mixed == []
    fast = run(enabled=True)
    # The long prompt went 7 tokens a step beside the short one's decode: rows of both in one call.
    assert [1, 7] in mixed or [7, 1] in mixed
    for a, b in zip(slow, fast, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
    assert slow[1].prompt_logprobs is not None and fast[1].prompt_logprobs is not None
    for pa, pb in zip(slow[1].prompt_logprobs[1:], fast[1].prompt_logprobs[1:], strict=True):
        assert pa is not None and pb is not None
        assert pa.logprob == pytest.approx(pb.logprob, abs=1e-4)
        assert [t for t, _ in pa.top_logprobs] == [t for t, _ in pb.top_logprobs]


def test_an_engine_that_serves_adapters_runs_steps_without_them_as_one_call(
    tiny_llama_dir, adapter_dirs, monkeypatch
):
    """LoRA's wrappers around the linears: a step with no adapter's rows takes the one-call layers
    (the base weights), a step with one keeps the layer path; tokens are the layer path's."""
    rows: list[int] = []

    def counted(self, x, *args, **kwargs):
        rows.append(x.shape[0])
        return _FORWARD(self, x, *args, **kwargs)

    monkeypatch.setattr(cpu_decode_layer.DecodeLayers, "forward", counted)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = prompts([20], seed=3)[0]
    adapter = LoRARef("r8", str(adapter_dirs["r8"]), "1")

    def run(enabled: bool, lora: LoRARef | None) -> tuple[list[int], list[int]]:
        monkeypatch.setenv("PAGODA_CPU_DECODE_LAYER", "1" if enabled else "0")
        engine = lora_engine(tiny_llama_dir)
        rows.clear()  # the warm-up's steps
        engine.add_request("r", prompt, params, tenant="acme", lora=lora)
        return run_to_completion(engine)["r"].outputs[0].token_ids, list(rows)

    base_slow, _ = run(False, None)
    base_fast, base_calls = run(True, None)
    assert base_fast == base_slow
    assert base_calls == [1] * 11  # every decode step (the 20-token prompt is wider than MIXED_MAX_ROWS)
    tuned_slow, _ = run(False, adapter)
    tuned_fast, tuned_calls = run(True, adapter)
    assert tuned_fast == tuned_slow != base_fast
    assert tuned_calls == []


@pytest.mark.skipif(
    cpu_decode_layer.max_rows(torch.bfloat16) == 0, reason="no bfloat16 dot products (AVX512-BF16) here"
)
def test_bfloat16_decode_steps_take_the_one_call_layers_and_agree_with_the_layer_path(
    tiny_llama_dir, monkeypatch
):
    """In bfloat16 the kernel rounds where the layer path rounds, and only the order of a product's
    sums differs: the greedy tokens agree, and where they part the two tokens were a near tie of
    the layer path's."""
    calls: list[int] = []

    def counted(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return _FORWARD(self, x, *args, **kwargs)

    monkeypatch.setattr(cpu_decode_layer.DecodeLayers, "forward", counted)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)
    batch = PROMPTS + [[(t + i) % 1000 for t in PROMPTS[i % 3]] for i in range(10)]

    def run(enabled: bool):
        monkeypatch.setenv("PAGODA_CPU_DECODE_LAYER", "1" if enabled else "0")
        llm = LLM(str(tiny_llama_dir), num_blocks=128, max_num_seqs=16, dtype="bfloat16")
        return llm.generate(PROMPTS[:1], params) + llm.generate(batch, params), llm.engine.runner.model

    slow, _ = run(enabled=False)
    assert calls == []
    fast, fast_model = run(enabled=True)
    assert fast_model._decode_layers is not None and fast_model._decode_layers.dtype == torch.bfloat16
    assert 1 in calls and (13 in calls) == (cpu_decode_layer.max_rows(torch.bfloat16) >= 13)
    identical = 0
    for a, b in zip(slow, fast, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs or [], b.outputs[0].logprobs or []
        parted = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        identical += parted == len(ta)
        for i in range(parted):
            assert la[i].logprob == pytest.approx(lb[i].logprob, abs=0.05)
        if parted < len(ta):
            tops = dict(la[parted].top_logprobs)
            assert tb[parted] in tops and tops[tb[parted]] >= la[parted].logprob - 0.1
    assert identical >= len(slow) // 2
