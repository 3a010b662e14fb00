"""Model implementations (the Llama family) and their offline loader."""

from __future__ import annotations

from engine.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    load_model_config,
)
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelLoadError",
    "UnsupportedModelError",
    "load_model",
    "load_model_config",
]
