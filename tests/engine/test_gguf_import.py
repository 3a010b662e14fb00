"""GGUF import: files as llama.cpp writes them become model directories the engine and transformers load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.gguf import GGUFImportError, import_gguf
from engine.gguf.gemma import query_pre_attn_scalar
from engine.llm import LLM
from engine.models.config import load_model_config
from engine.sampling_params import SamplingParams
from tests.engine.gguf_helpers import write_gguf
from tests.engine.lora_helpers import prompts
from tests.engine.test_parity import Recorder, hf_model

ROOT = Path(__file__).resolve().parents[2]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


# (fixture of the source model, GGUF architecture llama.cpp's converter gives it)
FAMILIES = [
    ("llama", "llama"),
    ("mistral", "mistral"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("phi3", "phi3"),
    ("mixtral", "llama"),
    ("qwen3moe", "qwen3moe"),
]


@pytest.mark.parametrize(("family", "arch"), FAMILIES)
def test_imported_tiny_model_has_the_weights_and_config_it_was_written_from(
    family: str, arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source: Path = request.getfixturevalue(f"tiny_{family}_dir")
    stored = write_gguf(source, tmp_path / "m.gguf", arch=arch)

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    got = _weights(out)
    # Phi-3's fused projections stay fused; merged experts come back one tensor per expert.
    assert set(got) == set(stored)
    for name, expected in stored.items():
        # Exactly the dequantized GGUF values, rows back in Hugging Face order.
        assert np.array_equal(got[name].numpy(), expected), name
    want, have = load_model_config(source), load_model_config(out)
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "qkv_bias", "qk_norm", "rotary_dims", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "moe_layers",
                  "sliding_window", "bos_token_id", "eos_token_ids"):  # fmt: skip
        assert getattr(have, field) == getattr(want, field), field
    assert have.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    # Llama 3 rope scaling travels as llama.cpp's rope_freqs tensor, LongRoPE as its factor tensors.
    want_scaling = {k: v for k, v in (want.rope_scaling or {}).items() if k != "rope_theta"}
    assert have.rope_scaling == (want_scaling or None)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_mixtral_with_one_tensor_per_expert_imports_as_with_merged_experts(
    tiny_mixtral_dir: Path, tmp_path: Path
) -> None:
    """GGUF files converted before llama.cpp merged the experts keep blk.N.ffn_gate.E.weight."""
    stored = write_gguf(tiny_mixtral_dir, tmp_path / "split.gguf", arch="llama", split_experts=True)
    write_gguf(tiny_mixtral_dir, tmp_path / "merged.gguf", arch="llama")

    split = import_gguf(tmp_path / "split.gguf", tmp_path / "split", dtype="float32", progress=False)
    merged = import_gguf(tmp_path / "merged.gguf", tmp_path / "merged", dtype="float32", progress=False)

    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in stored
    got, want = _weights(split), _weights(merged)
    assert set(got) == set(want) == set(stored)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert (split / "config.json").read_text() == (merged / "config.json").read_text()


def _hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0]


def _assert_imported_matches(source: Path, out: Path, lengths: list[int]) -> None:
    """The engine serving the import computes transformers' logits for the source model, and
    transformers reads the import as the source."""
    llm = LLM(str(out), num_blocks=64)
    rec = Recorder(llm)
    batch = prompts(lengths, seed=3)
    llm.generate(batch, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert rec.check_against(source) == sum(lengths) + 3 * len(lengths)
    torch.testing.assert_close(_hf_logits(out, batch[0]), _hf_logits(source, batch[0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("family", "arch"), [("phi3", "phi3"), ("mixtral", "llama"), ("qwen3moe", "qwen3moe")]
)
def test_imported_phi3_and_mixtures_of_experts_compute_the_source_models_logits(
    family: str, arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source: Path = request.getfixturevalue(f"tiny_{family}_dir")
    # F32 tensors: the import must be lossless.
    write_gguf(source, tmp_path / "m.gguf", arch=arch, quant="F32")

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    _assert_imported_matches(source, out, [9, 23])


def test_imported_phi3_takes_its_long_rope_factors_past_the_original_context(
    tiny_phi3_dir: Path, tmp_path: Path
) -> None:
    """A pre-training context of 48 tokens: past it, LongRoPE's long factors and an attention
    factor above one, which llama.cpp keeps as rope_factors_long and rope.scaling.attn_factor."""
    source = shutil.copytree(tiny_phi3_dir, tmp_path / "phi3-long")
    raw = json.loads((source / "config.json").read_text())
    raw["original_max_position_embeddings"] = raw["rope_parameters"]["original_max_position_embeddings"] = 48
    (source / "config.json").write_text(json.dumps(raw))
    write_gguf(source, tmp_path / "m.gguf", arch="phi3", quant="F32")

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["original_max_position_embeddings"] == 48
    assert config["rope_scaling"]["long_factor"] == raw["rope_parameters"]["long_factor"]
    scaling = load_model_config(out).rope_scaling
    assert scaling is not None
    assert scaling["attention_factor"] == pytest.approx(
        load_model_config(source).rope_scaling["attention_factor"]
    )
    assert scaling["attention_factor"] > 1.0
    _assert_imported_matches(source, out, [60, 75])


def _as_llama_cpp_runs_it(source: Path, dest: Path) -> Path:
    """The tiny Gemma with what llama.cpp's format cannot carry set to what llama.cpp assumes. Its
    query scalar (twice the head size) is not stored: llama.cpp takes the head size (the hidden
    size over the heads for the 27B models only). Gemma 3's layer pattern is not stored either:
    llama.cpp slides on five of every six layers, so both of the tiny model's layers slide."""
    out = shutil.copytree(source, dest)
    raw = json.loads((out / "config.json").read_text())
    raw["query_pre_attn_scalar"] = raw["head_dim"]
    if raw["model_type"] == "gemma3_text":
        raw["layer_types"] = [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(raw["num_hidden_layers"])
        ]
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_imported_gemma_has_the_weights_and_config_of_its_source(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source = _as_llama_cpp_runs_it(request.getfixturevalue(f"tiny_{arch}_dir"), tmp_path / "source")
    stored = write_gguf(source, tmp_path / "m.gguf", arch=arch)

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    got = _weights(out)
    assert "model.layers.1.pre_feedforward_layernorm.weight" in stored
    assert set(got) == set(stored)
    for name, expected in stored.items():
        # The norms less the one llama.cpp's converter adds, in float32 as the GGUF holds them.
        assert np.array_equal(got[name].numpy(), expected), name
    want, have = load_model_config(source), load_model_config(out)
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "qkv_bias", "qk_norm", "gemma", "hidden_act", "attention_scale",
                  "attn_logit_softcap", "final_logit_softcap", "layer_windows", "local_rope_theta",
                  "sliding_window", "bos_token_id"):  # fmt: skip
        assert getattr(have, field) == getattr(want, field), field
    assert have.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    want_scaling = {k: v for k, v in (want.rope_scaling or {}).items() if k != "rope_theta"}
    assert have.rope_scaling == (want_scaling or None)
    # The tiny models' own values, not the families' defaults, came through.
    if arch == "gemma2":
        assert (have.attn_logit_softcap, have.final_logit_softcap, have.layer_windows) == (
            5.0,
            8.0,
            (32, None),
        )
    else:
        assert (have.local_rope_theta, have.rope_theta, have.layer_windows) == (10000.0, 1e6, (32, 32))
        assert have.rope_scaling == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize(
    ("arch", "layer_pattern"),
    [("gemma2", False), ("gemma3", False), ("gemma3", True)],
    ids=["gemma2", "gemma3", "gemma3-stated-pattern"],
)
def test_imported_gemma_computes_the_source_models_logits_past_its_window(
    arch: str, layer_pattern: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Sequences past the 32-token window. With the layer pattern stated in the file (one flag per
    layer, as Ollama's converter writes it; llama.cpp's writes none), Gemma 3's second layer attends
    fully with its linearly scaled global rotary embedding, as the tiny model's does."""
    source = _as_llama_cpp_runs_it(request.getfixturevalue(f"tiny_{arch}_dir"), tmp_path / "source")
    if layer_pattern:
        raw = json.loads((source / "config.json").read_text())
        raw["layer_types"] = ["sliding_attention", "full_attention"]
        (source / "config.json").write_text(json.dumps(raw))
    write_gguf(source, tmp_path / "m.gguf", arch=arch, quant="F32", layer_pattern=layer_pattern)

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    assert load_model_config(out).layer_windows == (
        (32, None) if arch == "gemma2" or layer_pattern else (32, 32)
    )
    _assert_imported_matches(source, out, [9, 50])


def test_gemma3_without_a_window_attends_fully_on_every_layer(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """llama.cpp's converter writes no sliding_window for a Gemma 3 whose sliding_window_pattern is 1."""
    source = shutil.copytree(tiny_gemma3_dir, tmp_path / "source")
    raw = json.loads((source / "config.json").read_text())
    raw["sliding_window_pattern"] = 1
    (source / "config.json").write_text(json.dumps(raw))
    write_gguf(source, tmp_path / "m.gguf", arch="gemma3")

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "full_attention"]
    assert "sliding_window" not in config
    assert load_model_config(out).layer_windows == (None, None)


def test_gemma3_takes_the_local_rotary_base_of_ollamas_files(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """Ollama's own converter names the sliding layers' base rope.local.freq_base."""
    source = shutil.copytree(tiny_gemma3_dir, tmp_path / "source")
    raw = json.loads((source / "config.json").read_text())
    del raw["rope_parameters"]["sliding_attention"]["rope_theta"]  # no rope.freq_base_swa
    (source / "config.json").write_text(json.dumps(raw))
    write_gguf(
        source, tmp_path / "m.gguf", arch="gemma3", extra_fields={"gemma3.rope.local.freq_base": 20000.0}
    )

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    assert json.loads((out / "config.json").read_text())["rope_local_base_freq"] == 20000.0
    assert load_model_config(out).local_rope_theta == 20000.0


@pytest.mark.parametrize(
    ("arch", "layers", "hidden", "heads", "head_dim", "released"),
    [
        ("gemma2", 26, 2304, 8, 256, 256),  # Gemma 2 2B
        ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B
        ("gemma3", 34, 2560, 8, 256, 256),  # Gemma 3 4B
        ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B
    ],
)
def test_gemma_query_scalar_is_the_released_models_one(
    arch: str, layers: int, hidden: int, heads: int, head_dim: int, released: int
) -> None:
    """llama.cpp stores no query_pre_attn_scalar and tells the 27B models apart by layer count."""
    got = query_pre_attn_scalar(arch, layers=layers, hidden=hidden, heads=heads, head_dim=head_dim)
    assert got == released


def test_gemma2_with_a_sliding_rotary_base_of_its_own_is_refused(
    tiny_gemma2_dir: Path, tmp_path: Path
) -> None:
    write_gguf(
        tiny_gemma2_dir, tmp_path / "m.gguf", arch="gemma2", extra_fields={"gemma2.rope.freq_base_swa": 5e5}
    )
    with pytest.raises(GGUFImportError, match="Gemma 2 has one base for all layers"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_imported_model_generates_what_the_source_model_generates(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    # F32 tensors: the import must be lossless, so greedy tokens match the source model's.
    write_gguf(source, tmp_path / "m.gguf", arch=arch, quant="F32")
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Token ids: the GGUF's tokenizer is rebuilt by transformers' converter, whose pre-tokenizer
    # for this made-up vocabulary need not split text as the original did.
    prompts = [[5, 300, 17, 999, 42], [7, 8, 9]]
    want = [o.outputs[0].token_ids for o in LLM(str(source), num_blocks=64).generate(prompts, params)]
    llm = LLM(str(out), num_blocks=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    # The chat template came along with the tokenizer.
    from engine.make_model import CHAT_TEMPLATE

    assert llm.tokenizer.chat_template == CHAT_TEMPLATE
    assert llm.chat([{"role": "user", "content": "hi"}], params)[0].num_prompt_tokens > 3


def test_bfloat16_import_writes_bfloat16_weights(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    write_gguf(tiny_qwen2_dir, tmp_path / "m.gguf", arch="qwen2")
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="bfloat16", progress=False)
    assert {t.dtype for t in _weights(out).values()} == {torch.bfloat16}
    assert load_model_config(out).torch_dtype == "bfloat16"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_cli_shows_progress_and_prints_the_directory(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    write_gguf(tiny_mistral_dir, tmp_path / "m.gguf", arch="mistral")
    done = _cli("import-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str((tmp_path / "out").resolve())
    assert "importing" in done.stderr and "100%" in done.stderr
    assert load_model_config(tmp_path / "out").architecture == "MistralForCausalLM"


def test_other_architecture_is_refused_and_nothing_is_written(tiny_llama_dir: Path, tmp_path: Path) -> None:
    write_gguf(tiny_llama_dir, tmp_path / "m.gguf", arch="gemma")
    done = _cli("import-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert (
        "GGUF architecture 'gemma' is not supported "
        "(supported: llama, mistral, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3)" in done.stderr
    )
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_unreadable_tensor_type_is_refused_naming_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    write_gguf(
        tiny_llama_dir,
        tmp_path / "m.gguf",
        arch="llama",
        extra_tensors={"blk.0.odd.weight": np.zeros(4, np.float64)},
    )
    with pytest.raises(GGUFImportError, match=r"quantization type\(s\) F64 cannot be read"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_tensor_without_a_place_in_the_model_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    extra = {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}
    write_gguf(tiny_llama_dir, tmp_path / "m.gguf", arch="llama", extra_tensors=extra)
    with pytest.raises(GGUFImportError, match="'blk.0.attn_q_norm.weight' has no counterpart"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)


def test_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFImportError, match="not a readable GGUF file"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)


def test_existing_directory_is_kept_unless_overwrite_is_given(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    write_gguf(tiny_qwen2_dir, tmp_path / "m.gguf", arch="qwen2")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(GGUFImportError, match="exists and is not empty"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"
    import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False, overwrite=True)
    assert not (tmp_path / "out" / "mine.txt").exists()
    assert (tmp_path / "out" / "config.json").exists()


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_import_equals_transformers_own_gguf_dequantization(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out = import_gguf(smollm2_gguf, tmp_path / "smollm2", dtype="float32", progress=False)

    reference = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).state_dict()
    ours = _weights(out)
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    cfg = load_model_config(out)
    assert (
        cfg.architecture,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    ) == ("LlamaForCausalLM", 30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta, cfg.eos_token_ids) == (
        49152,
        True,
        100000.0,
        [2],
    )
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()
