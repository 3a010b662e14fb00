"""The plain-torch attention backend (the CPU path) against the slow reference, on awkward batches."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from engine.attention import torch_backend
from engine.attention.torch_backend import TorchAttentionBackend, plan_step
from kernels import cpu_paged_decode_attention as cpu_kernel
from kernels import cpu_paged_prefill_attention as cpu_prefill
from kernels.reference import ref_paged_attention, ref_store_kvcache
from tests.kernels.helpers import DTYPES, PagedBatch, assert_close, make_paged_batch

# (query_lens, seq_lens): decode-only steps, a lone fresh prompt, and mixed steps where decodes sit
# between fresh prompts and chunks that follow cached tokens (partial last blocks throughout).
BATCHES = [
    ([1, 1, 1], [300, 1, 63]),
    ([63], [63]),
    ([1, 15, 63, 1], [300, 15, 83, 1]),
    ([15, 1, 40, 1], [15, 300, 70, 17]),
    ([300, 1, 5], [300, 16, 21]),
    # enough decodes to be attended in groups of similar length, alone and beside chunks
    ([1] * 40, [(37 * i) % 300 + 1 for i in range(40)]),
    ([1] * 12 + [20] + [1] * 12 + [9], [*range(3, 300, 25), 20, *range(290, 1, -25), 40]),
]


def _expected(batch: PagedBatch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    ref_store_kvcache(batch.k, batch.v, k_cache, v_cache, batch.slot_mapping)
    out = ref_paged_attention(
        batch.q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    return out, k_cache


def _backend(path: str, monkeypatch: pytest.MonkeyPatch | None = None) -> TorchAttentionBackend:
    backend = TorchAttentionBackend()
    if path == "kernels+flash":  # fresh chunks of 20 tokens or more to torch's flash attention
        assert monkeypatch is not None
        monkeypatch.setattr(torch_backend, "FLASH_FRESH_MIN_TOKENS", 20)
        backend.flash_fresh_chunks = True
    if path == "torch":
        backend.use_cpu_kernel = False
        backend.use_cpu_prefill_kernel = False
    else:
        assert cpu_kernel.available(), "the CPU decode kernel must compile on this machine"
        assert cpu_prefill.available(), "the CPU prefill kernel must compile on this machine"
    return backend


# Decode rows and prompt chunks take the C kernels on CPU when they compiled, the torch paths
# (gathers, flash attention) otherwise, and long fresh chunks flash attention beside the kernels in
# bfloat16 on an AMX CPU: all three are tested.
PATHS = ["kernels", "torch", "kernels+flash"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("query_lens", "seq_lens"), BATCHES)
def test_the_torch_backend_matches_the_reference(dtype, group, query_lens, seq_lens, path, monkeypatch):
    batch = make_paged_batch(
        query_lens, seq_lens, num_kv_heads=2, group=group, head_dim=32, dtype=dtype, device="cpu"
    )
    expected, expected_k_cache = _expected(batch, 0.2)

    out = _backend(path, monkeypatch).forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata(), 0.2
    )

    assert torch.equal(batch.k_cache, expected_k_cache)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_one_backend_serves_successive_steps_of_every_shape(path, monkeypatch):
    # given one backend instance, as a model holds it, fed steps of growing and shrinking sizes
    backend = _backend(path, monkeypatch)
    for seed, (query_lens, seq_lens) in enumerate([*BATCHES, ([1] * 9, [1000, *range(1, 9)]), *BATCHES]):
        batch = make_paged_batch(
            query_lens,
            seq_lens,
            num_kv_heads=2,
            group=4,
            head_dim=32,
            dtype=torch.float32,
            device="cpu",
            seed=seed,
        )
        expected, _ = _expected(batch, 0.2)
        metadata = batch.metadata()

        # when every layer of the step calls it with the step's metadata
        outs = [
            backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, metadata, 0.2)
            for _ in range(3)
        ]

        # then each call attends over this step's contexts, never a previous step's plan or workspace
        for out in outs:
            assert_close(out, expected, torch.float32)


def test_long_fresh_chunks_take_flash_attention_and_the_rest_the_prefill_kernel():
    # a fresh 300-token prompt, a decode, a fresh 15-token prompt and a chunk after 40 cached tokens
    batch = make_paged_batch(
        [300, 1, 15, 30],
        [300, 20, 15, 70],
        num_kv_heads=2,
        group=4,
        head_dim=32,
        dtype=torch.float32,
        device="cpu",
    )
    plan = plan_step(batch.metadata(), batch.k_cache.shape[1], torch.float32, True, True, flash_fresh_min=100)
    assert [(c.start, c.end, c.blocks) for c in plan.chunks] == [(0, 300, None)]
    assert plan.kernel_chunks is not None and plan.kernel_chunks.starts.tolist() == [301, 316]
    unchanged = plan_step(batch.metadata(), batch.k_cache.shape[1], torch.float32, True, True)
    assert unchanged.chunks == [] and unchanged.kernel_chunks is not None
    assert unchanged.kernel_chunks.starts.tolist() == [0, 301, 316]


def test_flash_attention_takes_fresh_chunks_in_bfloat16_on_an_amx_cpu_only(monkeypatch):
    backend = TorchAttentionBackend()
    q32, q16 = torch.zeros(4, 8, 32), torch.zeros(4, 8, 32, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_prefill, "has_vector_tiles", lambda: True)
    for amx in (True, False):
        monkeypatch.setattr(torch_backend, "cpu_has_amx_bf16", lambda amx=amx: amx)
        assert backend._flash_fresh_min(q32, prefill_kernel=True) is None
        want = torch_backend.FLASH_FRESH_MIN_TOKENS if amx else None
        assert backend._flash_fresh_min(q16, prefill_kernel=True) == want
        assert backend._flash_fresh_min(q16, prefill_kernel=False) is None


def test_flash_attention_takes_fresh_chunks_in_either_dtype_where_the_kernel_has_no_vector_tiles(monkeypatch):
    backend = TorchAttentionBackend()
    monkeypatch.setattr(torch_backend, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(cpu_prefill, "has_vector_tiles", lambda: False)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.zeros(4, 8, 32, dtype=dtype)
        assert backend._flash_fresh_min(q, prefill_kernel=True) == torch_backend.FLASH_FRESH_MIN_TOKENS
        assert backend._flash_fresh_min(q, prefill_kernel=False) is None


def test_the_prefill_kernel_has_vector_tiles_on_an_avx512_cpu_unless_built_portable(monkeypatch):
    cpu_prefill.has_vector_tiles.cache_clear()
    monkeypatch.setattr(cpu_prefill._cpu_build, "portable", lambda: False)
    flags = Path("/proc/cpuinfo").read_text().split()
    assert cpu_prefill.has_vector_tiles() == (
        platform.machine().lower() in ("x86_64", "amd64") and "avx512f" in flags
    )
    cpu_prefill.has_vector_tiles.cache_clear()
    monkeypatch.setattr(cpu_prefill._cpu_build, "portable", lambda: True)
    assert cpu_prefill.has_vector_tiles() is False
    cpu_prefill.has_vector_tiles.cache_clear()
