"""Decode steps on CPU in float32 run each decoder layer as one C call (kernels.cpu_decode_layer,
chosen in LlamaForCausalLM._make_decode_layers): the engine's outputs are those of the
layer-by-layer path, steps wider than the kernel takes keep that path, and so do models the kernel
does not compute."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels import cpu_decode_layer

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="no C compiler for the CPU kernels")

_FORWARD = cpu_decode_layer.DecodeLayers.forward
PROMPTS = [[5, 9, 33, 70, 12, 8, 41], [100, 3, 7] * 9, [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74]]


def _run(model_dir, monkeypatch, enabled: bool):
    monkeypatch.setenv("PAGODA_CPU_DECODE_LAYER", "1" if enabled else "0")
    calls = []

    def counted(self, x, *args):
        calls.append(x.shape[0])
        return _FORWARD(self, x, *args)

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
    monkeypatch.setattr(cpu_decode_layer, "max_rows", lambda: 4)
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
