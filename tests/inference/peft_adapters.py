"""Real PEFT adapters for the adapter tests, saved by PEFT's own save_pretrained, and the helpers
that upload them (as Django's uploaded files) with Celery running tasks in the calling thread."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def make_peft_adapter(
    base_dir: Path, out_dir: Path, *, r: int = 8, alpha: int = 16, modules=ALL_MODULES, seed: int = 0
) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    # Random (seeded) lora_B as well as lora_A: PEFT's default zero lora_B would be an adapter that
    # changes nothing, and serving it could not be told apart from serving the base model.
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(modules), init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


def make_other_base(out_dir: Path) -> Path:
    """A Llama with other dimensions (hidden 32) than the served tiny model (hidden 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def reshape_tensor(adapter_dir: Path, out_dir: Path, *, name: str, shape: tuple[int, ...]) -> Path:
    """A copy of the adapter whose tensor `name` has another shape."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True)
    tensors = load_file(str(adapter_dir / WEIGHTS))
    tensors[name] = torch.zeros(shape)
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / CONFIG).write_bytes((adapter_dir / CONFIG).read_bytes())
    return out_dir


def files_of(adapter_dir: Path) -> list[SimpleUploadedFile]:
    return [SimpleUploadedFile(n, (adapter_dir / n).read_bytes()) for n in (CONFIG, WEIGHTS)]


def zip_bytes(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def zip_of(adapter_dir: Path, *, folder: str = "my-adapter/") -> bytes:
    return zip_bytes({folder + n: (adapter_dir / n).read_bytes() for n in (CONFIG, WEIGHTS)})


def files_on_disk(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.fixture(scope="session")
def adapters_dir(tmp_path_factory: pytest.TempPathFactory, served_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-adapters")
    good = make_peft_adapter(served_model_dir, root / "good", r=8, alpha=16)
    return {
        "good": good,
        "attention-r4": make_peft_adapter(
            served_model_dir, root / "attention-r4", r=4, alpha=8, modules=("q_proj", "v_proj"), seed=1
        ),
        "rank-128": make_peft_adapter(served_model_dir, root / "rank-128", r=128, alpha=128),
        "other-base": make_peft_adapter(make_other_base(root / "other-base-model"), root / "other-base", r=8),
        "bad-shape": reshape_tensor(
            good,
            root / "bad-shape",
            name="base_model.model.model.layers.1.mlp.down_proj.lora_A.weight",
            shape=(8, 64),
        ),
    }


@pytest.fixture
def media_root(settings, tmp_path: Path) -> Path:
    settings.MEDIA_ROOT = tmp_path / "media"
    return settings.MEDIA_ROOT


@pytest.fixture
def celery_eager() -> Iterator[None]:
    """Tasks run in the calling thread when scheduled (here: when the upload commits)."""
    from config.celery_app import app

    saved = (app.conf.task_always_eager, app.conf.task_eager_propagates)
    app.conf.task_always_eager, app.conf.task_eager_propagates = True, True
    yield
    app.conf.task_always_eager, app.conf.task_eager_propagates = saved
