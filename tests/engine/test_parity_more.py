"""Parity with transformers when everything happens at once, past Llama 3.1's original context,
with linear rope scaling, and for logprobs.

test_parity.py forces one mechanism per test; here chunked prefill, prefix-cache hits, parallel
sampling and preemption by recompute all happen in one run, which is where a block shared between a
sibling, a recompute and a cache hit could hand over the wrong KV.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import ARCH_FIXTURES, Recorder, _greedy, _prompts, hf_model


@pytest.mark.parametrize("arch", ARCH_FIXTURES)
def test_chunks_cache_hits_siblings_and_preemption_together_match_transformers(
    arch: str, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(arch)
    # Eight 16-token blocks; the six sequences would need about fourteen even sharing the prompt
    # prefix, so some are preempted and recomputed, and the recompute may hit cached blocks.
    llm = LLM(str(model_dir), num_blocks=8, max_num_batched_tokens=16, max_num_seqs=6)
    rec = Recorder(llm)
    shared = _prompts([34], seed=5)[0]
    tails = _prompts([3, 9, 1], seed=6)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([shared + t for t in tails], params)

    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert llm.engine.scheduler.block_manager.prefix_cache_stats()["hits"] > 0
    assert max(n for items, _ in rec.steps for _, _, n in items) == 16  # chunked to the budget
    # Greedy siblings agree with each other, whichever of them was preempted.
    for out in outs:
        assert len(out.outputs) == 2
        assert out.outputs[0].token_ids == out.outputs[1].token_ids and len(out.outputs[0].token_ids) == 8
    # The first prompt is computed before any other, so the later ones hit its two full blocks.
    assert outs[0].num_cached_tokens == 0 and [o.num_cached_tokens for o in outs[1:]] == [32, 32]
    assert stats["num_free_blocks"] == 8
    rec.check_against(model_dir)


def _hub_layout_llama31(src: Path, dst: Path) -> Path:
    """The tiny Llama rewritten with config.json as every Llama 3.1 checkpoint on the hub has it:
    rope_theta at the top level and the llama3 parameters under rope_scaling."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_llama31_rope_scaling_past_the_original_context_matches_transformers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = _hub_layout_llama31(tiny_llama_dir, tmp_path / "llama31")
    scaling = json.loads((model_dir / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["original_max_position_embeddings"] == 256
    llm = LLM(str(model_dir), num_blocks=40, max_num_batched_tokens=128)
    rec = Recorder(llm)
    # 300 prompt tokens: positions beyond the 256 the scaling was fitted to, in three chunks.
    outs = llm.generate(_prompts([300, 20], seed=7), _greedy(6))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert rec.check_against(model_dir) == 300 + 20 + 2 * 5


def test_llama3_rope_scaling_changes_the_logits(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Guards the test above: with scaling dropped, the same weights give other logits, so parity
    # there really depends on the scaled frequencies.
    plain = tmp_path / "plain"
    shutil.copytree(tiny_llama_dir, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(cfg))
    prompt = _prompts([40], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    scaled = LLM(str(tiny_llama_dir), num_blocks=8).generate(prompt, params)[0].outputs[0]
    unscaled = LLM(str(plain), num_blocks=8).generate(prompt, params)[0].outputs[0]
    assert abs(scaled.cumulative_logprob - unscaled.cumulative_logprob) > 1e-3


def test_linear_rope_scaling_matches_transformers(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "linear"
    shutil.copytree(tiny_mistral_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    theta = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": theta, "factor": 4.0}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(model_dir), num_blocks=16)
    rec = Recorder(llm)
    llm.generate(_prompts([25, 6], seed=9), _greedy(4))
    assert rec.check_against(model_dir) == 31 + 2 * 3


def test_llama2_shape_with_full_multi_head_attention_and_plain_rope_matches_transformers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Llama 2 layout: as many KV heads as query heads, rope without scaling.
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=176,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.08,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "llama2"
    LlamaForCausalLM(config).eval().save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, model_dir / name)
    llm = LLM(str(model_dir), num_blocks=16, max_num_batched_tokens=16)
    cfg = llm.engine.model_config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_scaling) == (4, 4, None)
    rec = Recorder(llm)
    llm.generate(_prompts([29, 5], seed=15), _greedy(5))
    assert rec.check_against(model_dir) == 34 + 2 * 4


def test_logprobs_equal_transformers_log_softmax(tiny_qwen2_dir: Path) -> None:
    prompt = _prompts([21], seed=10)[0]
    llm = LLM(str(tiny_qwen2_dir), num_blocks=16)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=20))[
        0
    ]
    c = out.outputs[0]
    with torch.no_grad():
        logits = hf_model(tiny_qwen2_dir)(torch.tensor([prompt + c.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # the distribution of each output
    sampled = c.logprobs
    assert [lp.token_id for lp in sampled] == c.token_ids
    for step, lp in enumerate(sampled):
        assert lp.rank == 1
        assert lp.logprob == pytest.approx(expected[step, lp.token_id].item(), abs=1e-4)
        assert len(lp.top_logprobs) == 20
        vals, ids = expected[step].topk(20)
        assert [t for t, _ in lp.top_logprobs] == ids.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4)
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in sampled), abs=1e-5)
