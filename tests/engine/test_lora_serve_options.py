"""The serve command's LoRA options become the engine's LoRAConfig."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, LoRAConfig
from engine.serve import build_parser, engine_config_from_args

REQUIRED = ["--model-dir", "/models/tiny", "--served-name", "tiny", "--redis-url", "redis://127.0.0.1:6379/0"]


def config_of(*flags: str):
    return engine_config_from_args(build_parser().parse_args([*REQUIRED, *flags]))


def test_lora_is_off_unless_enabled():
    assert config_of("--max-loras", "8").lora is None


def test_enabled_lora_takes_its_limits_and_a_host_cache_four_times_the_slots():
    assert config_of("--enable-lora", "--max-loras", "3", "--max-lora-rank", "32").lora == LoRAConfig(
        max_loras=3, max_cpu_loras=12, max_lora_rank=32
    )
    assert config_of("--enable-lora", "--max-cpu-loras", "5").lora == LoRAConfig(
        max_loras=4, max_cpu_loras=5, max_lora_rank=64
    )


def test_inconsistent_lora_limits_are_refused():
    with pytest.raises(ConfigError, match="max_cpu_loras >= max_loras"):
        config_of("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2")
