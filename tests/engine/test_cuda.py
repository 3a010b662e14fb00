"""The engine on a CUDA GPU: the Triton attention kernels compiled for real, the decode CUDA graphs,
bfloat16 against transformers, and the KV cache sized from the GPU's free memory.

Each test compares what the engine computed with one transformers forward over the finished
sequences (tests/engine/test_parity.py's Recorder), on the same GPU. In float32 the logits agree to
rounding noise and every greedy token is transformers' argmax. In bfloat16 two correct
implementations round differently (another summation order in the GEMMs and the attention), so the
logits agree to a tolerance in units of bfloat16's resolution, and a greedy token may be the other
side of a near-tie: `assert_greedy`'s ``tie``. Skipped without a GPU (marker ``gpu``).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.llm import LLM
from engine.models.moe import SparseMoeBlock
from engine.sampling_params import SamplingParams
from kernels import gpu_fused, moe_grouped_gemm
from tests.engine.test_parity import ARCH_FIXTURES, Recorder, _prompts, assert_greedy, hf_model

pytestmark = pytest.mark.gpu

F32_ATOL = 1e-3  # float32 on the GPU: differences of about 1e-5 seen (cuBLAS vs Triton sums)
BF16_ATOL = 0.25  # bfloat16 logits of magnitude up to ~4 on the tiny models: a few of its ulps
BF16_TIE = 0.25


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _release(*llms: LLM) -> None:
    """Engines hold their KV cache on the GPU until collected; the next test needs the memory."""
    for llm in llms:
        llm.engine.runner.kv_caches.clear()
    gc.collect()
    torch.cuda.empty_cache()


def _eager_engine(model_dir: Path, dtype: str) -> LLM:
    """Without CUDA graphs, so that the Recorder sees every forward; a 48-token step budget chunks
    the longer prompts and mixes them with decodes."""
    return LLM(
        str(model_dir),
        device="cuda",
        dtype=dtype,
        num_blocks=128,
        max_num_batched_tokens=48,
        enforce_eager=True,
    )


@pytest.mark.parametrize("arch", ARCH_FIXTURES)
def test_mixed_chunked_and_cached_steps_match_transformers_in_float32(
    arch: str, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(arch)
    llm = _eager_engine(model_dir, "float32")
    model = llm.engine.runner.model
    assert model.backend.name == "triton"
    rec = Recorder(llm)
    shared = _prompts([40], seed=2)[0]
    llm.generate([shared + [7, 8]], _greedy(4))
    # The norms, the MLP activation and the rotary embedding with the K/V store: one Triton launch
    # each (kernels.gpu_fused). Gemma's (1 + w) norms and GELU gate take the torch forms, and so
    # does Phi-3's partial rotary embedding, which the kernel is not even given.
    layer = model.model.layers[0]
    cfg = model.config
    assert layer.input_layernorm.fused is gpu_fused
    assert layer.mlp.fused is gpu_fused
    whole_rotary = layer.self_attn.rotary_dim == layer.self_attn.head_dim
    assert (layer.self_attn.fused is gpu_fused) == whole_rotary
    moe = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert bool(moe) == bool(cfg.num_experts)
    # Chunked (a 48-token budget), mixed with decodes, then prefix-cache hits on the shared blocks.
    outs = llm.generate(_prompts([1, 7, 33, 90], seed=5) + [shared + [9], shared], _greedy(12))
    assert [o.num_cached_tokens for o in outs[-2:]] == [32, 32]
    if moe:
        # The experts ran as Triton grouped GEMMs (kernels.moe_grouped_gemm), compiled for this GPU.
        kernel = moe_grouped_gemm._moe_grouped_gemm_kernel
        assert kernel.device_caches[torch.cuda.current_device()][0]
    compared = rec.check_against(model_dir, atol=F32_ATOL, device="cuda")
    print(f"{arch} float32 on cuda: {compared} positions, largest logit difference {rec.max_diff:.2e}")
    _release(llm)


@pytest.mark.parametrize("arch", ARCH_FIXTURES)
def test_bfloat16_on_cuda_matches_transformers_in_bfloat16(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(arch)
    llm = _eager_engine(model_dir, "bfloat16")
    rec = Recorder(llm)
    outs = llm.generate(_prompts([1, 7, 33, 90, 17], seed=6), _greedy(16))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    if llm.engine.runner.model.config.num_experts:
        # Routing near-ties: the mixture of experts is held to transformers' own bfloat16 error.
        mean, their_mean, worst, their_worst = rec.check_as_close_to_float32(model_dir, device="cuda")
        print(
            f"{arch} bfloat16 on cuda, against float32: mean {mean:.3f} (transformers {their_mean:.3f}), "
            f"worst {worst:.3f} (transformers {their_worst:.3f})"
        )
        _release(llm)
        return
    compared = rec.check_against(model_dir, atol=BF16_ATOL, dtype=torch.bfloat16, device="cuda", tie=BF16_TIE)
    print(f"{arch} bfloat16 on cuda: {compared} positions, largest logit difference {rec.max_diff:.3f}")
    _release(llm)


def _counting_replays(llm: LLM) -> list[int]:
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "CUDA graphs were not captured"
    sizes: list[int] = []
    replay = graphs.replay

    def counted(inputs):
        sizes.append(inputs.metadata.num_seqs)
        return replay(inputs)

    graphs.replay = counted
    return sizes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replays_decode_what_the_eager_forward_decodes(dtype: str, tiny_llama_dir: Path) -> None:
    kwargs = dict(device="cuda", dtype=dtype, num_blocks=256, max_num_seqs=16)
    graphed = LLM(str(tiny_llama_dir), cuda_graph_batch_sizes=(1, 2, 4, 8, 16), **kwargs)
    eager = LLM(str(tiny_llama_dir), enforce_eager=True, **kwargs)
    replays = _counting_replays(graphed)
    # Prompts of different lengths finish prefill together, then decode as a batch of 11 (padded to
    # 16), shrinking as the shorter requests end: 8, 4, 2 and 1 are replayed too.
    prompts = _prompts([5, 17, 30, 64, 3, 12, 40, 9, 21, 2, 50], seed=7)
    lengths = [40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 2]
    params = [_greedy(n) for n in lengths]
    ours = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    theirs = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert {b for b in replays} >= {11, 9, 7, 5, 3, 1}
    assert len(replays) >= max(lengths) - 2
    hf = hf_model(tiny_llama_dir, getattr(torch, dtype), "cuda")
    tie = 0.0 if dtype == "float32" else BF16_TIE
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0].float().cpu()
        assert_greedy(logits[len(prompt) - 1 : -1], tokens, tie)
    if dtype == "float32":
        assert ours == theirs
    else:
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        print(f"bfloat16: {same}/{len(ours)} requests decode identically with and without graphs")
    _release(graphed, eager)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_speculation_on_cuda_decodes_the_tokens_of_plain_decoding(
    proposer: str, tiny_llama_dir: Path
) -> None:
    """Verification steps (several query tokens a sequence, eager) run between the graph-replayed
    decodes of the sequences not speculating; in float32 the greedy tokens are those of an engine
    that never speculates, and every block goes back to the pool."""
    kwargs = dict(device="cuda", dtype="float32", num_blocks=256, max_num_seqs=16)
    draft = str(tiny_llama_dir) if proposer == "draft_model" else None
    spec = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, draft_model=draft, draft_num_blocks=96
    )
    # Repeating prompts give n-gram lookup its matches; the random ones give it none to find.
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 4, *_prompts([17, 40, 9, 26], seed=23)]
    params = [_greedy(n) for n in (40, 32, 24, 40, 16, 32)]
    plain = LLM(str(tiny_llama_dir), **kwargs)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    fast = LLM(str(tiny_llama_dir), speculative=spec, **kwargs)
    replays = _counting_replays(fast)
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    assert got == want
    stats = fast.engine.get_stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    if proposer == "draft_model":  # the model as its own draft: its greedy tokens, up to float ties
        assert stats["spec_acceptance_rate"] > 0.9
    bm = fast.engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks
    print(
        f"{proposer} on cuda: {stats['spec_num_accepted_tokens']}/{stats['spec_num_draft_tokens']} drafts "
        f"accepted, {len(replays)} graph replays"
    )
    _release(plain, fast)


def test_the_kv_cache_takes_the_configured_share_of_gpu_memory(tiny_llama_dir: Path) -> None:
    _release()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2)
    runner = llm.engine.runner
    cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    # The budget is the share less what the weights, the warm-up's activations and other
    # processes hold; a tiny model leaves nearly all of it to the cache, and none beyond it.
    assert 0.15 * total < cache_bytes <= 0.2 * total
    assert torch.cuda.memory_allocated() <= 0.2 * total + 256 * 2**20
    out = llm.generate([_prompts([20], seed=8)[0]], _greedy(8))[0]
    assert len(out.outputs[0].token_ids) == 8
    print(f"kv cache: {cache_bytes / 2**30:.2f} GiB of {total / 2**30:.1f} GiB, {runner.num_blocks} blocks")
    _release(llm)


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_on_cuda_matches_transformers(dtype: str, smollm2_dir: Path) -> None:
    from tests.engine.real_chats import CHATS

    llm = LLM(
        str(smollm2_dir),
        device="cuda",
        dtype=dtype,
        max_num_batched_tokens=64,
        max_num_seqs=32,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
    )
    rec = Recorder(llm)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    cold = llm.chat(CHATS, params)
    warm = llm.chat(CHATS, params)
    assert sum(o.num_cached_tokens for o in cold) < sum(o.num_cached_tokens for o in warm)
    f32 = dtype == "float32"
    compared = rec.check_against(
        smollm2_dir,
        atol=1e-2 if f32 else 2.0,
        dtype=getattr(torch, dtype),
        device="cuda",
        tie=0.0 if f32 else 1.0,
    )
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cold, warm, strict=True))
    print(
        f"smollm2 {dtype} on cuda: {compared} positions, largest logit difference {rec.max_diff:.4f}; "
        f"{same}/{len(cold)} chats identical cold and cached"
    )
    _release(llm)


def _compiled_kernels() -> int:
    """How many Triton kernels this process has compiled for the current GPU, over the engine's
    kernels (each entry of a JITFunction's cache is one set of compile-time constants)."""
    from kernels import gpu_fused, paged_decode_attention, prefill_attention, store_kvcache

    jitted = [
        obj
        for module in (gpu_fused, paged_decode_attention, prefill_attention, store_kvcache)
        for obj in vars(module).values()
        if hasattr(obj, "device_caches")
    ]
    device = torch.cuda.current_device()
    return sum(len(fn.device_caches[device][0]) for fn in jitted if device in fn.device_caches)


def test_the_warm_up_compiles_what_the_first_requests_need(tiny_llama_dir: Path) -> None:
    # Shapes the earlier tests compiled are cached in this process: a context length they did not
    # use (max_model_len 1536) gives this engine block tables of widths of its own.
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="bfloat16", max_model_len=1536, num_blocks=512)
    assert llm.engine.warm_up_seconds > 0
    before = _compiled_kernels()
    prompts = _prompts([3, 20, 45, 130, 700, 1200], seed=9)
    outs = llm.generate(prompts, _greedy(8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    print(
        f"warm-up {llm.engine.warm_up_seconds:.2f} s; compiled by the first requests: {_compiled_kernels() - before}"
    )
    assert _compiled_kernels() == before
    _release(llm)
