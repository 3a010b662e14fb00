"""Shared engine fixtures: tiny random-weight model directories, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    # The test machine's cores are shared; tiny models gain nothing from more threads.
    torch.set_num_threads(2)


def _build(tmp_path_factory: pytest.TempPathFactory, arch: str, **kwargs) -> Path:
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, size="tiny", seed=0, **kwargs)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3 shape: GQA (4 heads, 2 KV heads), llama3 rope scaling, untied embeddings, float32."""
    return _build(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 shape: an RMSNorm over each q and k head (random weights), no q/k/v bias."""
    return _build(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-4-mini shape: fused qkv and gate_up weights, LongRoPE (short factors) over 3/4 of each head."""
    return _build(tmp_path_factory, "phi3")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixtral shape: every MLP a mixture of 8 experts, 2 per token, weights renormalised."""
    return _build(tmp_path_factory, "mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE shape: q/k norms, a dense first layer (mlp_only_layers), then 8 experts, 2 per token."""
    return _build(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2 shape: a 32-token window on every other layer, soft-capped scores and logits."""
    return _build(tmp_path_factory, "gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 shape: q/k norms, a 32-token window with its own rope base on the first layer, a
    linearly scaled rope on the full one."""
    return _build(tmp_path_factory, "gemma3")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 shape: bias on the q/k/v projections."""
    return _build(tmp_path_factory, "qwen2")
