"""Does a stored PEFT LoRA adapter fit its base deployment? Every answer but "yes" is a reason a
person can act on (retrain with a smaller rank, pick the right base model, re-save as LoRA)."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.rules import LORA_ATTENTION_MODULES as ATTENTION_MODULES
from engine.rules import LORA_TARGET_MODULES as SUPPORTED_MODULES
from engine.rules import lora_module_dims, lora_unsupported_options, moe_layers
from inference.services.adapter_files import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterUploadError,
    TensorInfo,
    read_safetensors_header,
)

logger = logging.getLogger(__name__)

FLOAT_DTYPES = ("F32", "F16", "BF16")
# PEFT's names once the adapter name is stripped on save, e.g.
# base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
    r"(?P<module>[A-Za-z_]+)\.lora_(?P<ab>[AB])\.weight$"
)


class AdapterInvalid(Exception):
    """The adapter cannot be served; `reason` says why and what to do."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    rank: int
    alpha: float
    target_modules: list[str]


@dataclass(frozen=True, slots=True)
class BaseDims:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is a mixture of experts (no LoRA there)

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        return lora_module_dims(
            hidden=self.hidden_size,
            intermediate=self.intermediate_size,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )[module]


def base_dims(*, model_path: str, base_name: str) -> BaseDims:
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return BaseDims(
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            moe_layers=moe_layers(raw),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # The reason is the operator's to read (it names the host's paths), not the tenant's.
        logger.warning("base model %s cannot be read for adapter checks: %s", base_name, exc)
        raise AdapterInvalid(
            f"The base model `{base_name}` cannot be read; ask the platform operator to check "
            "that deployment, then upload the adapter again."
        ) from exc


def _read_config(adapter_dir: Path) -> dict[str, Any]:
    try:
        raw = json.loads((adapter_dir / CONFIG_NAME).read_text())
    except UnicodeDecodeError as exc:
        raise AdapterInvalid(f"{CONFIG_NAME} is not UTF-8 text ({exc.reason}).") from exc
    except OSError as exc:
        logger.warning("%s of an adapter in %s cannot be read: %s", CONFIG_NAME, adapter_dir, exc)
        raise AdapterInvalid(f"{CONFIG_NAME} cannot be read.") from exc
    except ValueError as exc:
        raise AdapterInvalid(
            f"{CONFIG_NAME} is not valid JSON ({exc}). Re-save the adapter with PEFT."
        ) from exc
    except RecursionError as exc:
        raise AdapterInvalid(f"{CONFIG_NAME} is nested too deeply to be an adapter config.") from exc
    if not isinstance(raw, dict):
        raise AdapterInvalid(f"{CONFIG_NAME} must hold a JSON object.")
    return raw


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def adapter_spec(*, config: dict[str, Any], max_rank: int) -> AdapterSpec:
    peft_type = config.get("peft_type")
    if str(peft_type).upper() != "LORA":
        raise AdapterInvalid(
            f'{CONFIG_NAME} has peft_type {peft_type!r}; only LoRA adapters (peft_type "LORA") can be served.'
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not _is_int(rank) or rank < 1:
        raise AdapterInvalid(
            f"{CONFIG_NAME} needs `r`, the LoRA rank, as a positive integer; it has {rank!r}."
        )
    if rank > max_rank:
        raise AdapterInvalid(
            f"The adapter's rank r={rank} is above the maximum rank {max_rank} this base model serves. "
            f"Train the adapter again with r <= {max_rank}."
        )
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise AdapterInvalid(f"{CONFIG_NAME} needs `lora_alpha` as a positive number; it has {alpha!r}.")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise AdapterInvalid(
            f"{CONFIG_NAME} gives target_modules as a pattern ({targets!r}); list the module names instead, "
            f"from {', '.join(SUPPORTED_MODULES)}."
        )
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterInvalid(f"{CONFIG_NAME} needs `target_modules`, a non-empty list of module names.")
    unsupported = sorted(set(targets) - set(SUPPORTED_MODULES))
    if unsupported:
        raise AdapterInvalid(
            f"target_modules lists {', '.join(unsupported)}, which cannot carry an adapter here; "
            f"adapters may target {', '.join(SUPPORTED_MODULES)}."
        )
    for key in lora_unsupported_options(config):
        if key == "bias":
            raise AdapterInvalid(
                f'{CONFIG_NAME} sets bias={config["bias"]!r}; only bias "none" is supported.'
            )
        raise AdapterInvalid(f"{CONFIG_NAME} sets {key}, which is not supported. Train a plain LoRA adapter.")
    return AdapterSpec(
        rank=rank, alpha=float(alpha), target_modules=sorted(set(targets), key=SUPPORTED_MODULES.index)
    )


def _check_tensors(
    *, tensors: dict[str, TensorInfo], spec: AdapterSpec, dims: BaseDims, base_name: str, trained_on: str
) -> None:
    if not tensors:
        raise AdapterInvalid(f"{WEIGHTS_NAME} holds no tensors.")
    seen: dict[tuple[int, str], set[str]] = {}
    misfits: list[str] = []
    for name, info in sorted(tensors.items()):
        match = _TENSOR.match(name)
        if match is None:
            raise AdapterInvalid(
                f"Tensor `{name}` is not a LoRA weight of an attention or MLP projection "
                "(expected names like base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)."
            )
        layer, module, ab = int(match["layer"]), match["module"], match["ab"]
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        if module not in SUPPORTED_MODULES or match["block"] != block:
            raise AdapterInvalid(
                f"Tensor `{name}` targets `{match['block']}.{module}`, which cannot carry an adapter."
            )
        if module not in spec.target_modules:
            raise AdapterInvalid(
                f"Tensor `{name}` is for {module}, which {CONFIG_NAME}'s target_modules does not list."
            )
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterInvalid(
                f"Tensor `{name}` has dtype {info.dtype}; LoRA weights must be F32, F16 or BF16."
            )
        if layer >= dims.num_layers:
            raise AdapterInvalid(
                f"Tensor `{name}` is for layer {layer}, but the base model `{base_name}` has "
                f"{dims.num_layers} layers. {_other_base_hint(trained_on)}"
            )
        if block == "mlp" and layer in dims.moe_layers:
            raise AdapterInvalid(
                f"Tensor `{name}` is for the MLP of layer {layer}, which in the base model `{base_name}` is a "
                "mixture of experts; adapters here may target its attention projections only."
            )
        in_features, out_features = dims.features(module)
        expected = (spec.rank, in_features) if ab == "A" else (out_features, spec.rank)
        if info.shape != expected:
            role = "(r, in_features)" if ab == "A" else "(out_features, r)"
            misfits.append(
                f"Tensor `{name}` has shape {list(info.shape)}, but the base model `{base_name}` with r={spec.rank} "
                f"needs {list(expected)} (lora_{ab} is {role} of {module})."
            )
        seen.setdefault((layer, module), set()).add(ab)
    if misfits:
        if len(misfits) == len(tensors):
            hint = _other_base_hint(trained_on)
        else:
            hint = (
                f"{len(tensors) - len(misfits)} of its {len(tensors)} tensors fit, so the weights file looks "
                "damaged or edited: save the adapter again with PEFT."
            )
        more = f" ({len(misfits) - 1} more tensors do not fit either.)" if len(misfits) > 1 else ""
        raise AdapterInvalid(f"{misfits[0]}{more} {hint}")
    for (layer, module), parts in sorted(seen.items()):
        if parts != {"A", "B"}:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise AdapterInvalid(f"{module} of layer {layer} has no {missing} weight in {WEIGHTS_NAME}.")
    unused = [m for m in spec.target_modules if not any(mod == m for _, mod in seen)]
    if unused:
        raise AdapterInvalid(
            f"target_modules lists {', '.join(unused)}, but {WEIGHTS_NAME} holds no weights for it. "
            "Re-save the adapter with PEFT."
        )


def _other_base_hint(trained_on: str) -> str:
    if trained_on:
        return f"The adapter names {trained_on!r} as its base model: was it trained on a different one?"
    return "Was the adapter trained on a different base model?"


def adapter_check(*, adapter_dir: Path, model_path: str, base_name: str, max_rank: int) -> AdapterSpec:
    """The adapter's rank, alpha and targets when it fits the base model; AdapterInvalid otherwise."""
    config = _read_config(adapter_dir)
    spec = adapter_spec(config=config, max_rank=max_rank)
    try:
        tensors = read_safetensors_header(adapter_dir / WEIGHTS_NAME)
    except AdapterUploadError as exc:
        raise AdapterInvalid(exc.message) from exc
    dims = base_dims(model_path=model_path, base_name=base_name)
    trained_on = str(config.get("base_model_name_or_path") or "")
    _check_tensors(tensors=tensors, spec=spec, dims=dims, base_name=base_name, trained_on=trained_on)
    return spec
