"""engine.rules: the rules the web tier and the engine share are one module, and both sides obey it."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from rest_framework import serializers

from engine import rules

ROOT = Path(__file__).resolve().parents[1]
BASE_ADAPTER = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def test_rules_import_only_the_standard_library() -> None:
    tree = ast.parse((ROOT / "engine" / "rules.py").read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_every_engine_setting_is_an_option_of_engine_serve() -> None:
    from engine.serve import build_parser

    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    flags = {*rules.ENGINE_SETTING_FLAGS.values(), *rules.ENGINE_SETTING_SWITCHES.values()}
    assert flags <= options, flags - options
    assert set(rules.ENGINE_SETTING_DEFAULTS) <= set(rules.ENGINE_SETTING_SWITCHES)


def test_every_engine_settings_kind_is_what_engine_serve_parses() -> None:
    import argparse

    from engine.serve import build_parser, parse_size

    actions = {opt: action for action in build_parser()._actions for opt in action.option_strings}
    parsed_as = {"int": int, "float": float, "size": parse_size, "text": None}
    for key, kind in rules.ENGINE_SETTINGS.items():
        action = actions["--" + key.replace("_", "-")]
        if kind == "switch":
            assert isinstance(action, argparse._StoreTrueAction), key
        else:
            assert action.type is parsed_as[kind] and action.nargs is None, key


@pytest.mark.parametrize(
    ("engine_settings", "errors"),
    [
        ({}, []),
        (
            {"max_num_seqs": 16, "gpu_memory_utilization": 0.5, "kv_cache_memory": "512MiB", "device": "cpu"},
            [],
        ),
        ({"grammar_cache_bytes": 1_000_000, "enforce_eager": True, "seed": None}, []),
        ({"max_num_seqs": "16"}, ["max_num_seqs must be an integer, got '16'"]),
        ({"max_num_seqs": True}, ["max_num_seqs must be an integer, got True"]),
        ({"heartbeat_interval": float("nan")}, ["heartbeat_interval must be a number, got nan"]),
        (
            {"kv_cache_memory": [1]},
            ["kv_cache_memory must be a number of bytes or a size such as 512MiB, got [1]"],
        ),
        ({"enable_lora": 1}, ["enable_lora must be true or false, got 1"]),
        ({"device": 0}, ["device must be text, got 0"]),
        ([], ["engine_settings must be an object of key: value"]),
    ],
)
def test_engine_settings_are_checked_by_kind(engine_settings, errors) -> None:
    assert rules.engine_settings_errors(engine_settings) == errors


def test_sizes_read_as_the_engine_reads_them() -> None:
    assert rules.parse_size("512MiB") == 512 * 2**20
    assert rules.parse_size("1.5GB") == 1_500_000_000
    assert rules.parse_size(" 1000 ") == 1000
    with pytest.raises(ValueError, match="not a size"):
        rules.parse_size("lots")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("use_dora", True),
        ("fan_in_fan_out", True),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 4}),
        ("alpha_pattern", {"q_proj": 4}),
        ("layers_pattern", "layers"),
        ("target_parameters", ["w"]),
        ("bias", "all"),
    ],
)
def test_an_adapter_option_the_engine_cannot_serve_is_refused_by_both_sides(
    option, value, tmp_path: Path
) -> None:
    from engine.lora.loader import LoRALoadError, read_adapter_config
    from inference.services.adapter_checks import AdapterInvalid, adapter_spec

    config = {**BASE_ADAPTER, option: value}
    with pytest.raises(AdapterInvalid, match=option):
        adapter_spec(config=config, max_rank=64)
    (tmp_path / rules.ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(LoRALoadError, match=option):
        read_adapter_config(tmp_path)


def test_a_plain_lora_config_passes_both_sides(tmp_path: Path) -> None:
    from engine.lora.loader import read_adapter_config
    from inference.services.adapter_checks import adapter_spec

    assert adapter_spec(config=BASE_ADAPTER, max_rank=64).target_modules == ["q_proj", "v_proj"]
    (tmp_path / rules.ADAPTER_CONFIG_FILE).write_text(json.dumps(BASE_ADAPTER))
    assert read_adapter_config(tmp_path)["r"] == 8


@pytest.mark.parametrize(
    ("config", "length"),
    [
        ({"max_position_embeddings": 4096}, 4096),
        ({}, 2048),
        ({"max_position_embeddings": 32768, "sliding_window": 4096}, 4096),
        ({"max_position_embeddings": 32768, "sliding_window": None}, 32768),
        ({"model_type": "qwen2", "max_position_embeddings": 32768, "sliding_window": 4096}, 32768),
        ({"model_type": "qwen3", "max_position_embeddings": 40960, "sliding_window": 4096}, 40960),
        (
            {
                "model_type": "qwen2",
                "max_position_embeddings": 32768,
                "sliding_window": 4096,
                "use_sliding_window": True,
            },
            4096,
        ),
    ],
)
def test_web_tier_and_engine_agree_on_the_context_length(config: dict, length: int, tmp_path: Path) -> None:
    from engine.models.config import load_model_config
    from inference.services.deployments import model_context_limit

    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
        config.get("model_type"), "MistralForCausalLM"
    )
    full = {
        "architectures": [arch],
        "vocab_size": 64,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        **config,
    }
    (tmp_path / "config.json").write_text(json.dumps(full))
    assert rules.model_context_length(full) == length
    assert model_context_limit(model_path=tmp_path) == length
    assert load_model_config(tmp_path).max_model_len == length


def test_a_non_positive_context_length_is_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        rules.model_context_length({"max_position_embeddings": 0})


def test_stop_string_limits_are_the_engines_and_the_schema_states_them() -> None:
    """The web side checks `stop` with the engine's SamplingParams (one validator), and the
    OpenAPI schema states the same bounds."""
    from engine.sampling_params import SamplingParams, SamplingParamsError
    from inference.api.fields import _STOP_STRING, sampling_params_check

    longest = "x" * rules.MAX_STOP_STRING_CHARS
    most = ["a", "b", "c", longest]
    attrs = {"stop": list(most)}
    sampling_params_check(attrs)
    assert attrs["stop"] == SamplingParams(stop=most).stop == most
    assert _STOP_STRING["maxLength"] == rules.MAX_STOP_STRING_CHARS
    for refused in (["x" * (rules.MAX_STOP_STRING_CHARS + 1)], ["a"] * (rules.MAX_STOP_STRINGS + 1)):
        with pytest.raises(serializers.ValidationError) as refusal:
            sampling_params_check({"stop": refused})
        assert "stop" in refusal.value.detail
        with pytest.raises(SamplingParamsError):
            SamplingParams(stop=refused)
