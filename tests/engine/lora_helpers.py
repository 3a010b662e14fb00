"""PEFT adapters with seeded random weights for the tiny model, and an engine that serves them.

PEFT initialises lora_B to zero (an adapter that changes nothing), so every LoRA parameter is
overwritten from a seeded generator before save_pretrained: the saved directory is exactly what a
fine-tuning run writes, with weights that move the logits.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name -> (rank, alpha, targets, use_rslora, seed)
ADAPTER_SPECS = {
    "r8": (8, 16, ALL_TARGETS, False, 1),
    "r16": (16, 8, ALL_TARGETS, False, 2),
    "qv4": (4, 8, ("q_proj", "v_proj"), True, 3),
}


def make_peft_adapter(
    model_dir: Path,
    out: Path,
    *,
    rank: int,
    alpha: int,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(out)  # safetensors
    return out


@pytest.fixture(scope="session")
def adapter_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(
            tiny_llama_dir, root / name, rank=r, alpha=a, targets=t, use_rslora=rs, seed=s
        )
        for name, (r, a, t, rs, s) in ADAPTER_SPECS.items()
    }


_peft_models: dict[tuple[Path, Path | None], torch.nn.Module] = {}


def reference_model(model_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """transformers (+ PEFT when an adapter is named) on the same files the engine reads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (model_dir, adapter_dir)
    if key not in _peft_models:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir)
        _peft_models[key] = model.eval()
    return _peft_models[key]


def lora_engine(
    model_dir: Path,
    *,
    max_loras: int = 4,
    max_cpu_loras: int = 8,
    max_lora_rank: int = 16,
    num_blocks: int = 128,
    max_num_seqs: int = 16,
    enable_prefix_caching: bool = True,
    device: str = "cpu",
) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype="float32",
            cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(
                max_model_len=512, max_num_batched_tokens=256, max_num_seqs=max_num_seqs
            ),
            lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank),
        )
    )


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 2000) for _ in range(n)] for n in lengths]
