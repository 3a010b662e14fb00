"""`python -m engine ...`: the command line an operator (or run_engine) starts the engine with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def engine_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serve_help_lists_the_serve_options():
    result = engine_cli("serve", "--help")

    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m engine serve ")
    for option in ("--model-dir", "--served-name", "--redis-url", "--max-num-seqs", "--kv-cache-memory"):
        assert option in result.stdout


def test_top_level_help_lists_both_subcommands():
    result = engine_cli("--help")

    assert result.returncode == 0
    assert "make-model" in result.stdout
    assert "serve" in result.stdout


def test_serve_without_a_model_dir_is_a_usage_error():
    result = engine_cli("serve", "--served-name", "m", "--redis-url", "redis://127.0.0.1:6379/0")

    assert result.returncode == 2
    assert "the following arguments are required: --model-dir" in result.stderr


def test_serve_with_a_missing_model_dir_exits_with_a_clear_message(tmp_path):
    missing = tmp_path / "nope"

    result = engine_cli(
        "serve", "--model-dir", str(missing), "--served-name", "m", "--redis-url", "redis://127.0.0.1:1/0"
    )

    assert result.returncode == 2
    assert result.stderr.strip() == f"error: model directory {str(missing)!r} does not exist"


def test_serve_with_a_directory_that_is_not_a_model_exits_with_a_clear_message(tmp_path):
    result = engine_cli(
        "serve", "--model-dir", str(tmp_path), "--served-name", "m", "--redis-url", "redis://127.0.0.1:1/0"
    )

    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path}: missing config.json"
    assert "Traceback" not in result.stderr


def test_serve_with_an_unsupported_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))

    result = engine_cli(
        "serve", "--model-dir", str(tmp_path), "--served-name", "m", "--redis-url", "redis://127.0.0.1:1/0"
    )

    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {tmp_path}: architecture ['GPT2LMHeadModel'] is not supported")


def test_speculation_is_off_unless_the_serve_options_ask_for_it():
    from engine.config import SpeculativeConfig
    from engine.serve import build_parser, engine_config_from_args

    base = ["--model-dir", "/m", "--served-name", "m", "--redis-url", "redis://127.0.0.1:6379/0"]
    assert engine_config_from_args(build_parser().parse_args(base)).speculative is None
    args = build_parser().parse_args(
        [*base, "--num-speculative-tokens", "5", "--prompt-lookup-min", "1", "--prompt-lookup-max", "4"]
    )
    assert engine_config_from_args(args).speculative == SpeculativeConfig(
        num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=4
    )
    args = build_parser().parse_args(
        [
            *base,
            "--num-speculative-tokens",
            "3",
            "--speculative-draft-model",
            "/draft",
            "--speculative-draft-blocks",
            "99",
        ]
    )
    assert engine_config_from_args(args).speculative == SpeculativeConfig(
        num_speculative_tokens=3, draft_model="/draft", draft_num_blocks=99
    )
    with pytest.raises(ConfigError, match="needs --num-speculative-tokens"):
        engine_config_from_args(build_parser().parse_args([*base, "--speculative-draft-model", "/draft"]))


def test_a_bad_speculation_setting_exits_with_a_clear_message(tmp_path):
    result = engine_cli(
        "serve",
        "--model-dir",
        str(tmp_path),
        "--served-name",
        "m",
        "--redis-url",
        "redis://127.0.0.1:6379/0",
        "--num-speculative-tokens",
        "4",
        "--prompt-lookup-min",
        "6",
    )
    assert result.returncode == 2
    assert "prompt_lookup_min <= prompt_lookup_max" in result.stderr
