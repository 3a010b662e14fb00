"""The plain-torch attention backend (the CPU path) against the slow reference, on awkward batches."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
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


def _backend(path: str) -> TorchAttentionBackend:
    backend = TorchAttentionBackend()
    if path == "torch":
        backend.use_cpu_kernel = False
        backend.use_cpu_prefill_kernel = False
    else:
        assert cpu_kernel.available(), "the CPU decode kernel must compile on this machine"
        assert cpu_prefill.available(), "the CPU prefill kernel must compile on this machine"
    return backend


# Decode rows and prompt chunks take the C kernels on CPU when they compiled, the torch paths
# (gathers, flash attention) otherwise: both are tested.
PATHS = ["kernels", "torch"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("query_lens", "seq_lens"), BATCHES)
def test_the_torch_backend_matches_the_reference(dtype, group, query_lens, seq_lens, path):
    batch = make_paged_batch(
        query_lens, seq_lens, num_kv_heads=2, group=group, head_dim=32, dtype=dtype, device="cpu"
    )
    expected, expected_k_cache = _expected(batch, 0.2)

    out = _backend(path).forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata(), 0.2
    )

    assert torch.equal(batch.k_cache, expected_k_cache)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_one_backend_serves_successive_steps_of_every_shape(path):
    # given one backend instance, as a model holds it, fed steps of growing and shrinking sizes
    backend = _backend(path)
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
