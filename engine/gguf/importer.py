"""``python -m engine import-gguf FILE.gguf --out DIR``: a GGUF file as an ordinary model directory.

Writes config.json, model.safetensors (sharded past a size), generation_config.json and the
tokenizer files with the chat template, all from the one GGUF file, so the engine, transformers
and other engines load the result offline. Quantized weights are dequantized (the engine computes
in float32, bfloat16 or float16). Everything is written to a temporary directory beside ``out``
and moved into place at the end: an interrupted import leaves no half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.gguf.config import architecture, generation_config, hf_config
from engine.gguf.fields import GGUFImportError
from engine.gguf.tensors import check_tensors, iter_hf_tensors, rope_tensors, weight_count

DTYPES = ("bfloat16", "float32", "float16")
SHARD_BYTES = 2 << 30
# Written last: its presence says the directory is complete; it also names the source file.
IMPORT_RECORD = "pagoda_import.json"


def open_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # gguf-py raises ValueError, struct.error, ... for a file that is not GGUF
        raise GGUFImportError(f"{path}: not a readable GGUF file ({exc})") from exc


def _write_weights(reader: Any, out: Path, dtype: torch.dtype, progress: bool) -> None:
    """model.safetensors, or shards of at most SHARD_BYTES and their index; one shard in memory at a time."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    written: list[list[str]] = []  # tensor names of each shard saved so far
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        save_file(current, str(out / f"part-{len(written)}.safetensors"), metadata={"format": "pt"})
        written.append(list(current))
        current.clear()

    with tqdm(
        total=weight_count(reader),
        unit="param",
        unit_scale=True,
        desc="importing",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        for name, tensor in iter_hf_tensors(reader, dtype):
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > SHARD_BYTES:
                flush()
                size = 0
            current[name] = tensor
            size += nbytes
            bar.update(tensor.numel())
    if not written:
        save_file(current, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    flush()
    weight_map = {}
    for i, names in enumerate(written):
        shard = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(out / f"part-{i}.safetensors", out / shard)
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer as transformers converts a GGUF's `tokenizer.ggml.*` fields, chat template included."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises several types for tokenizers it cannot convert
        raise GGUFImportError(f"{path.name}: the GGUF's tokenizer could not be converted ({exc})") from exc
    tokenizer.save_pretrained(str(out))
    template = getattr(tokenizer, "chat_template", None)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    # Loaders that read only tokenizer_config.json (older transformers, other engines) find it there.
    if template and "chat_template" not in config:
        config["chat_template"] = template
    config.pop("local_files_only", None)
    config.pop("is_local", None)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
    record: dict[str, Any] | None = None,
) -> Path:
    """Convert ``gguf_path`` into the model directory ``out``; return ``out``."""
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    path, out_path = Path(gguf_path).resolve(), Path(out).resolve()
    if out_path.exists() and any(out_path.iterdir()) and not overwrite:
        raise GGUFImportError(f"{out_path} exists and is not empty (pass --overwrite to replace it)")
    reader = open_gguf(path)
    architecture(reader)
    check_tensors(reader)
    names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = hf_config(
        reader,
        dtype=dtype,
        vocab_size=int(embed.shape[1]),
        tied="output.weight" not in names,
        rope_tensors=rope_tensors(reader),
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(reader), indent=2))
        _write_weights(reader, tmp, getattr(torch, dtype), progress)
        if progress:
            print("converting the tokenizer and chat template...", file=sys.stderr, flush=True)
        _write_tokenizer(path, tmp)
        meta = {"source": path.name, "dtype": dtype, **(record or {})}
        (tmp / IMPORT_RECORD).write_text(json.dumps(meta, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model directory is read by other processes
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        if out_path.exists():
            shutil.rmtree(out_path)
        os.replace(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_path
