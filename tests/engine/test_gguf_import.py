"""GGUF import: files as llama.cpp writes them become model directories the engine and transformers load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.gguf import GGUFImportError, import_gguf
from engine.models.config import load_model_config
from tests.engine.gguf_helpers import write_gguf

ROOT = Path(__file__).resolve().parents[2]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_imported_tiny_model_has_the_weights_and_config_it_was_written_from(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    stored = write_gguf(source, tmp_path / "m.gguf", arch=arch)

    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", dtype="float32", progress=False)

    got = _weights(out)
    assert set(got) == set(stored)
    for name, expected in stored.items():
        # Exactly the dequantized GGUF values, rows back in Hugging Face order.
        assert np.array_equal(got[name].numpy(), expected), name
    want, have = load_model_config(source), load_model_config(out)
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "qkv_bias", "qk_norm", "bos_token_id", "eos_token_ids"):  # fmt: skip
        assert getattr(have, field) == getattr(want, field), field
    assert have.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    if arch == "llama":  # Llama 3 rope scaling travels as llama.cpp's rope_freqs tensor
        want_scaling = {k: v for k, v in want.rope_scaling.items() if k != "rope_theta"}
        assert have.rope_scaling == want_scaling
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_imported_model_generates_what_the_source_model_generates(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

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
    write_gguf(tiny_llama_dir, tmp_path / "m.gguf", arch="gemma2")
    done = _cli("import-gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert (
        "GGUF architecture 'gemma2' is not supported (supported: llama, mistral, qwen2, qwen3)" in done.stderr
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
