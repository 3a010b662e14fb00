"""`manage.py model_register`: model directories become deployments, idempotently."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from inference.models import ModelDeployment

pytestmark = pytest.mark.django_db


def model_dir(root: Path, **config) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **config}))
    return root


def register(*args: str) -> str:
    out = io.StringIO()
    call_command("model_register", *args, stdout=out)
    return out.getvalue()


def test_register_creates_an_enabled_deployment_sized_from_config_json(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=4096)

    output = register("--name", "demo", "--path", str(path))

    deployment = ModelDeployment.objects.get(name="demo")
    assert (deployment.model_path, deployment.max_model_len, deployment.dtype) == (str(path), 4096, "auto")
    assert deployment.enabled is True
    assert deployment.engine_settings == {}
    assert output == (
        f"model demo created: {path} (task generate, max_model_len 4096, dtype auto, tool call parser hermes, "
        "reasoning parser none, engine settings {}, replica wait 0 s)\n"
    )


def test_a_relative_path_is_stored_absolute(tmp_path, monkeypatch):
    model_dir(tmp_path / "models" / "m", max_position_embeddings=512)
    monkeypatch.chdir(tmp_path)

    register("--name", "demo", "--path", "models/m")

    assert ModelDeployment.objects.get(name="demo").model_path == str(tmp_path / "models" / "m")


def test_max_model_len_is_capped_by_the_model(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=1024)

    register("--name", "short", "--path", str(path), "--max-model-len", "256")
    register("--name", "long", "--path", str(path), "--max-model-len", "100000")

    assert ModelDeployment.objects.get(name="short").max_model_len == 256
    assert ModelDeployment.objects.get(name="long").max_model_len == 1024


def test_an_active_sliding_window_caps_the_context_like_the_engine(tmp_path):
    mistral = model_dir(
        tmp_path / "mistral", model_type="mistral", max_position_embeddings=8192, sliding_window=4096
    )
    qwen = model_dir(
        tmp_path / "qwen",
        model_type="qwen2",
        max_position_embeddings=8192,
        sliding_window=4096,
        use_sliding_window=False,
    )

    register("--name", "mistral", "--path", str(mistral))
    register("--name", "qwen", "--path", str(qwen))

    assert ModelDeployment.objects.get(name="mistral").max_model_len == 4096
    assert ModelDeployment.objects.get(name="qwen").max_model_len == 8192


def test_registering_again_updates_the_same_row(tmp_path):
    first = model_dir(tmp_path / "v1", max_position_embeddings=2048)
    second = model_dir(tmp_path / "v2", max_position_embeddings=2048)
    register("--name", "demo", "--path", str(first), "--engine-setting", "max_num_seqs=64")
    pk = ModelDeployment.objects.get(name="demo").pk
    ModelDeployment.objects.filter(pk=pk).update(enabled=False)

    output = register(
        "--name", "demo", "--path", str(second), "--max-model-len", "512", "--dtype", "float32",
        "--engine-setting", "kv_cache_memory=256MiB",
    )  # fmt: skip

    [deployment] = ModelDeployment.objects.all()
    assert deployment.pk == pk
    assert (deployment.model_path, deployment.max_model_len, deployment.dtype) == (
        str(second),
        512,
        "float32",
    )
    assert deployment.engine_settings == {"max_num_seqs": 64, "kv_cache_memory": "256MiB"}
    assert deployment.enabled is False  # the operator's choice survives a re-registration
    assert output.startswith("model demo updated: ")


def test_registering_twice_with_the_same_arguments_changes_nothing(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    args = ("--name", "demo", "--path", str(path), "--engine-setting", "enforce_eager=true")
    register(*args)
    before = ModelDeployment.objects.values(
        "pk", "model_path", "max_model_len", "dtype", "engine_settings"
    ).get()

    register(*args)

    after = ModelDeployment.objects.values(
        "pk", "model_path", "max_model_len", "dtype", "engine_settings"
    ).get()
    assert after == before
    assert after["engine_settings"] == {"enforce_eager": True}


def test_an_engine_setting_of_null_removes_the_stored_one(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    register(
        "--name",
        "demo",
        "--path",
        str(path),
        "--engine-setting",
        "max_num_seqs=8",
        "--engine-setting",
        "seed=3",
    )

    register("--name", "demo", "--path", str(path), "--engine-setting", "max-num-seqs=null")

    assert ModelDeployment.objects.get(name="demo").engine_settings == {"seed": 3}


def test_the_registered_deployment_gives_the_engine_command_line(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    register("--name", "demo", "--path", str(path), "--engine-setting", "num_blocks=32", "--dtype", "float32")
    out = io.StringIO()

    call_command("run_engine", "--model", "demo", "--print-command", stdout=out)

    command = out.getvalue()
    assert f"--model-dir={path} " in command
    assert " --max-model-len=2048 --dtype=float32 " in command
    assert command.strip().endswith("--num-blocks=32")


def test_a_directory_without_config_json_is_refused_and_nothing_is_written(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")

    with pytest.raises(CommandError) as refused:
        register("--name", "demo", "--path", str(tmp_path))

    assert str(refused.value) == (
        f"{tmp_path} has no config.json: point at a Hugging Face model directory "
        "(config.json, *.safetensors, tokenizer files)"
    )
    assert not ModelDeployment.objects.exists()


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(CommandError) as refused:
        register("--name", "demo", "--path", str(tmp_path / "nope"))

    assert str(refused.value) == f"model directory {str(tmp_path / 'nope')!r} does not exist"
    assert not ModelDeployment.objects.exists()


def test_a_malformed_config_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")

    with pytest.raises(CommandError, match=r"config.json is not valid JSON"):
        register("--name", "demo", "--path", str(tmp_path))

    assert not ModelDeployment.objects.exists()


def test_an_unknown_engine_setting_is_refused_before_anything_is_written(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)

    with pytest.raises(CommandError, match=r"unknown engine setting 'warp_speed'; known: block_size, "):
        register("--name", "demo", "--path", str(path), "--engine-setting", "warp_speed=9")

    assert not ModelDeployment.objects.exists()


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ("max_num_seqs=lots", "max_num_seqs must be an integer"),
        ("gpu_memory_utilization=true", "must be a number"),
    ],
)
def test_an_engine_setting_of_the_wrong_kind_is_refused_before_anything_is_written(tmp_path, setting, error):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)

    with pytest.raises(CommandError, match=error):
        register("--name", "demo", "--path", str(path), "--engine-setting", setting)

    assert not ModelDeployment.objects.exists()


def test_the_registration_service_refuses_engine_settings_an_engine_would_refuse(tmp_path):
    from core.errors import InvalidRequestError
    from inference.services import deployment_register

    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    with pytest.raises(InvalidRequestError, match="max_num_seqs must be an integer"):
        deployment_register(name="demo", model_path=path, engine_settings={"max_num_seqs": "64 please"})
    with pytest.raises(InvalidRequestError, match="unknown engine setting 'warp_speed'"):
        deployment_register(name="demo", model_path=path, engine_settings={"warp_speed": 9})
    assert not ModelDeployment.objects.exists()
    deployment, _ = deployment_register(name="demo", model_path=path, engine_settings={"max_num_seqs": 64})
    assert deployment.engine_settings == {"max_num_seqs": 64}


def test_an_invalid_served_name_is_refused(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)

    with pytest.raises(
        CommandError, match=r"^model deployment 'bad name' is invalid \(name: Letters, digits"
    ):
        register("--name", "bad name", "--path", str(path))

    assert not ModelDeployment.objects.exists()


def engine_command(model: str = "demo") -> str:
    """The engine command line `run_engine` prints for a deployment."""
    out = io.StringIO()
    call_command("run_engine", "--model", model, "--print-command", stdout=out)
    return out.getvalue()


def test_engines_serve_adapters_unless_the_deployment_turns_them_off(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    register("--name", "demo", "--path", str(path), "--engine-setting", "max_loras=2")
    command = engine_command()
    assert " --enable-lora --max-loras=2" in command

    register("--name", "demo", "--path", str(path), "--engine-setting", "enable_lora=false")
    command = engine_command()
    assert "--enable-lora" not in command


def test_the_platforms_claim_timeout_reaches_the_engine_unless_the_deployment_sets_its_own(
    tmp_path, settings
):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    settings.REQUEST_CLAIM_TIMEOUT_MS = 4321
    register("--name", "demo", "--path", str(path))
    command = engine_command()
    assert " --claim-timeout-ms=4321" in command

    register("--name", "demo", "--path", str(path), "--engine-setting", "claim_timeout_ms=2000")
    command = engine_command()
    assert " --claim-timeout-ms=2000" in command and "4321" not in command


def test_the_platforms_failover_bound_reaches_the_engine_unless_the_deployment_sets_its_own(
    tmp_path, settings
):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    settings.MAX_FAILOVERS = 5
    register("--name", "demo", "--path", str(path))
    assert " --max-failovers=5" in engine_command()

    register("--name", "demo", "--path", str(path), "--engine-setting", "max_failovers=0")
    command = engine_command()
    assert " --max-failovers=0" in command and "--max-failovers=5" not in command


def test_an_architecture_the_engine_does_not_implement_is_refused_naming_the_served_ones(tmp_path):
    path = tmp_path / "falcon"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    )
    with pytest.raises(CommandError) as refused:
        call_command("model_register", "--name", "falcon", "--path", str(path))
    assert "architecture ['FalconForCausalLM'] is not supported (supported: LlamaForCausalLM, " in str(
        refused.value
    )
    from engine.rules import SERVED_ARCHITECTURES

    assert all(arch in str(refused.value) for arch in SERVED_ARCHITECTURES)
    assert "Phi3ForCausalLM" in SERVED_ARCHITECTURES and "MixtralForCausalLM" in SERVED_ARCHITECTURES
    assert not ModelDeployment.objects.exists()


def test_the_parsers_are_set_kept_when_not_given_and_turned_off_with_none(tmp_path):
    path = model_dir(tmp_path / "m")
    register(
        "--name",
        "qwen",
        "--path",
        str(path),
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "llama3_json",
    )
    deployment = ModelDeployment.objects.get(name="qwen")
    assert (deployment.tool_call_parser, deployment.reasoning_parser) == ("llama3_json", "qwen3")

    register("--name", "qwen", "--path", str(path))  # scripts/up.sh registers again on every start
    deployment.refresh_from_db()
    assert (deployment.tool_call_parser, deployment.reasoning_parser) == ("llama3_json", "qwen3")

    register(
        "--name", "qwen", "--path", str(path), "--reasoning-parser", "none", "--tool-call-parser", "none"
    )
    deployment.refresh_from_db()
    assert (deployment.tool_call_parser, deployment.reasoning_parser) == ("", "")


@pytest.mark.parametrize(
    ("arch", "parser"), [("MixtralForCausalLM", "mistral"), ("Phi3ForCausalLM", "phi4_mini_json")]
)
def test_mistral_and_phi4_mini_models_are_registered_with_their_tool_call_parsers(tmp_path, arch, parser):
    path = model_dir(tmp_path / "m", architectures=[arch])

    output = register("--name", "m", "--path", str(path), "--tool-call-parser", parser)

    assert ModelDeployment.objects.get(name="m").tool_call_parser == parser
    assert f"tool call parser {parser}, " in output


def test_an_unknown_tool_call_parser_is_refused_naming_the_known_ones(tmp_path):
    path = model_dir(tmp_path / "m")
    with pytest.raises(
        CommandError, match="invalid choice: 'pythonic'.*hermes.*llama3_json.*mistral.*phi4_mini_json.*none"
    ):
        register("--name", "m", "--path", str(path), "--tool-call-parser", "pythonic")
    assert not ModelDeployment.objects.exists()


def test_an_unknown_parser_is_refused_naming_the_known_ones(tmp_path):
    path = model_dir(tmp_path / "m")
    with pytest.raises(CommandError, match="invalid choice: 'r1'.*qwen3.*deepseek_r1.*none"):
        register("--name", "qwen", "--path", str(path), "--reasoning-parser", "r1")
    assert not ModelDeployment.objects.exists()


def test_a_decoder_registered_to_embed_keeps_its_task_and_its_engine_is_told(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=1024)
    output = register("--name", "gte", "--path", str(path), "--task", "embed")
    assert "(task embed, max_model_len 1024, dtype auto, engine settings {}, replica wait 0 s)" in output
    register("--name", "gte", "--path", str(path))  # scripts/up.sh registers again on every start
    assert ModelDeployment.objects.get(name="gte").task == ModelDeployment.Task.EMBED
    out = io.StringIO()
    call_command("run_engine", "--model", "gte", "--print-command", stdout=out)
    assert " --served-name=gte --task=embed " in out.getvalue()
    register("--name", "gte", "--path", str(path), "--task", "generate")
    assert ModelDeployment.objects.get(name="gte").task == ModelDeployment.Task.GENERATE


def test_an_encoder_cannot_be_registered_to_generate(tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "model_type": "bert", "max_position_embeddings": 512})
    )
    with pytest.raises(CommandError, match="an encoder .BERT family. cannot generate; its task is embed"):
        register("--name", "minilm", "--path", str(bert), "--task", "generate")
    assert not ModelDeployment.objects.exists()
    # A deployment told to embed on a decoder, moved onto an encoder, keeps embedding; one that
    # generated, moved onto an encoder without a task, takes the encoder's.
    decoder = model_dir(tmp_path / "m")
    register("--name", "chat", "--path", str(decoder))
    register("--name", "chat", "--path", str(bert))
    assert ModelDeployment.objects.get(name="chat").task == ModelDeployment.Task.EMBED


def test_the_engine_command_line_serves_the_health_port_the_environment_names(tmp_path, settings):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)
    register("--name", "demo", "--path", str(path))
    settings.ENGINE_HEALTH_PORT = 8001
    out = io.StringIO()

    call_command("run_engine", "--model", "demo", "--print-command", stdout=out)

    assert " --health-port=8001" in out.getvalue()
    settings.ENGINE_HEALTH_PORT = 0
    out = io.StringIO()
    call_command("run_engine", "--model", "demo", "--print-command", stdout=out)
    assert "--health-port" not in out.getvalue()


def test_register_sets_the_replica_wait_of_a_model_scaled_to_zero_and_keeps_it_after(tmp_path):
    path = model_dir(tmp_path / "m", max_position_embeddings=2048)

    register("--name", "demo", "--path", str(path), "--replica-wait-seconds", "180")
    register("--name", "demo", "--path", str(path))

    assert ModelDeployment.objects.get(name="demo").replica_wait_seconds == 180
    with pytest.raises(CommandError, match="replica_wait_seconds must be >= 0"):
        register("--name", "demo", "--path", str(path), "--replica-wait-seconds", "-1")
