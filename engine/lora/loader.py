"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into host tensors.

Only safetensors are read (a pickled adapter_model.bin is refused, never unpickled). Every tensor's
name and shape are checked against the base model before anything reaches a device slot, and the
PEFT scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B so that serving needs no
per-adapter scale.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.errors import LoRALoadError
from engine.models.config import ModelConfig
from engine.rules import ADAPTER_CONFIG_FILE as CONFIG_FILE
from engine.rules import ADAPTER_WEIGHTS_FILE as WEIGHTS_FILE
from engine.rules import LORA_FUSED_PARTS, lora_module_dims, lora_unsupported_options

# The fused linears of engine.models.llama and the PEFT target modules each one stands for, in the
# order their output columns are laid out.
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "qkv_proj": "self_attn",
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.lora_(A|B)\.weight$"
)


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA target module of the base model."""
    return lora_module_dims(
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


@dataclass(slots=True)
class LoRAAdapter:
    path: str
    rank: int  # the largest module rank; smaller modules are zero-padded to it
    # (layer, module) -> (A (rank, in_features), B (out_features, rank) with the scaling folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(root: Path) -> dict:
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError as exc:
        raise LoRALoadError(f"{root}: missing {CONFIG_FILE}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRALoadError(f"{root}: unreadable {CONFIG_FILE} ({exc})") from exc
    if not isinstance(config, dict):
        raise LoRALoadError(f"{root}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"{root}: peft_type {config.get('peft_type')!r} is not LORA")
    named = lora_unsupported_options(config)
    if named:
        raise LoRALoadError(f"{root}: unsupported adapter options: {', '.join(named)}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoRALoadError(f"{root}: lora_alpha must be a number, got {alpha!r}")
    return config


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = root / WEIGHTS_FILE
    if not path.exists():
        hint = (
            " (pickled adapter_model.bin files are not loaded)"
            if (root / "adapter_model.bin").exists()
            else ""
        )
        raise LoRALoadError(f"{root}: missing {WEIGHTS_FILE}{hint}")
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise LoRALoadError(f"{path}: unreadable safetensors file ({exc})") from exc


def load_adapter(path: str | Path, cfg: ModelConfig, *, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    root = Path(path)
    config = read_adapter_config(root)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    dims = module_dims(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(root).items():
        m = _KEY.match(name)
        if m is None:
            raise LoRALoadError(
                f"{root}: unexpected tensor {name!r} (targets are q,k,v,o,gate,up,down projections)"
            )
        layer, parent, proj, which = int(m.group(1)), m.group(2), f"{m.group(3)}_proj", m.group(4)
        if parent != _PARENT.get(proj, "mlp") or layer >= cfg.num_layers:
            raise LoRALoadError(f"{root}: {name!r} names no module of the base model")
        if parent == "mlp" and layer in cfg.moe_layers:
            raise LoRALoadError(
                f"{root}: {name!r}: layer {layer}'s MLP is a mixture of experts, which adapters do not target"
            )
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise LoRALoadError(f"{root}: {WEIGHTS_FILE} holds no LoRA weights")
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"{root}: layer {layer} {proj}"
        if set(ab) != {"A", "B"}:
            raise LoRALoadError(f"{where} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        in_features, out_features = dims[proj]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.shape != (r, in_features) or b.shape != (out_features, r):
            raise LoRALoadError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"({in_features} in, {out_features} out)"
            )
        if not 1 <= r <= max_rank:
            raise LoRALoadError(f"{where}: rank {r} exceeds this engine's max_lora_rank {max_rank}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRALoadError(f"{where}: LoRA weights must be floating point")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        a, b = a.float(), b.float() * scale
        # A fused target is its parts' LoRA with one A between them: B's rows split by part.
        parts = LORA_FUSED_PARTS.get(proj, (proj,))
        row = 0
        for part in parts:
            if (layer, part) in modules:
                raise LoRALoadError(f"{where}: {part} is also adapted on its own")
            rows = dims[part][1]
            modules[(layer, part)] = (a, b[row : row + rows])
            row += rows
    rank = max(a.shape[0] for a, _ in modules.values())
    weights = {key: _pad(a, b, rank, dtype) for key, (a, b) in modules.items()}
    return LoRAAdapter(path=str(root), rank=rank, weights=weights)


def _pad(
    a: torch.Tensor, b: torch.Tensor, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # Zero rows of A and columns of B add nothing, so modules of a smaller rank share the adapter's.
    r = a.shape[0]
    if r < rank:
        a = torch.cat([a, a.new_zeros(rank - r, a.shape[1])])
        b = torch.cat([b, b.new_zeros(b.shape[0], rank - r)], dim=1)
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()
