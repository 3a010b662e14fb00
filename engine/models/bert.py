"""The BERT encoder family (BERT, MiniLM, the sentence-transformers models built on them) in plain
torch over a packed token batch, with the model's pooling: what an embedding deployment runs.

Inputs of any lengths are laid out back to back (no padding): the linears and norms run once over
every token of the batch, and only attention, which is bidirectional within each input, runs per
input. There is no KV cache: an encoder reads its input once. Pooling (mean, CLS, last token, max)
and normalization follow the model's sentence-transformers files (`modules.json`,
`1_Pooling/config.json`), as `SentenceTransformer.encode` applies them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelLoadError, UnsupportedModelError
from engine.rules import model_task

POOLING_MODES = ("mean", "cls", "last", "max")


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: mode (mean, cls, last, max) and normalization."""

    mode: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {self.mode!r}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc})") from exc


def is_encoder(model_dir: str | Path) -> bool:
    """Whether the directory holds a BERT-family encoder (config.json's model_type or architecture)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return False
    try:
        return model_task(_read_json(path)) == "embed"
    except ValueError:
        return False


def load_encoder_config(model_dir: str | Path) -> EncoderConfig:
    raw = _read_json(Path(model_dir) / "config.json")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(
            f"{model_dir}: position_embedding_type {raw['position_embedding_type']!r}"
        )
    act = raw.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
        raise UnsupportedModelError(f"{model_dir}: hidden_act {act!r}")
    try:
        cfg = EncoderConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir}/config.json: {exc!r}") from exc
    if cfg.hidden_size % cfg.num_heads:
        raise ModelLoadError(f"{model_dir}: hidden_size is not a multiple of num_attention_heads")
    return cfg


def load_pooling(model_dir: str | Path) -> Pooling:
    """The pooling a sentence-transformers directory declares; a plain encoder: mean, normalized
    (what sentence-transformers itself assumes for a bare transformer)."""
    root = Path(model_dir)
    modules_path = root / "modules.json"
    if not modules_path.exists():
        return Pooling()
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path}: not a list of modules")
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    mode = "mean"
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            config = _read_json(root / str(module.get("path", "")) / "config.json")
            if config.get("pooling_mode_cls_token"):
                mode = "cls"
            elif config.get("pooling_mode_lasttoken"):
                mode = "last"
            elif config.get("pooling_mode_max_tokens"):
                mode = "max"
            elif config.get("pooling_mode_mean_sqrt_len_tokens") or config.get(
                "pooling_mode_weightedmean_tokens"
            ):
                raise UnsupportedModelError(f"{model_dir}: pooling {config} is not supported")
    return Pooling(mode=mode, normalize=normalize)


class _Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.attn_out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.out_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim)
        attended = torch.empty(tokens, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        start = 0
        for length in lengths:
            # (1, heads, length, head_dim) per input: attention never crosses inputs. Four
            # dimensions, or SDPA's CPU dispatch takes its unfused form.
            q, k, v = qkv[start : start + length].permute(1, 2, 0, 3)[:, None]
            attended[start : start + length] = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
            start += length
        x = self.attn_norm(x + self.attn_out(attended.view(tokens, -1)))
        hidden = self.up(x)
        if self.act == "relu":
            hidden = F.relu(hidden)
        else:
            hidden = F.gelu(hidden, approximate="none" if self.act == "gelu" else "tanh")
        return self.out_norm(x + self.down(hidden))


class BertEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embed_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Token states (tokens, hidden) of inputs laid out back to back, `lengths` tokens each."""
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, lengths)
        return x


def pool(states: torch.Tensor, lengths: list[int], pooling: Pooling) -> torch.Tensor:
    """One vector per input, (inputs, hidden), in float32."""
    states = states.float()
    if pooling.mode == "mean":
        index = torch.repeat_interleave(
            torch.arange(len(lengths), device=states.device), torch.tensor(lengths, device=states.device)
        )
        sums = torch.zeros(len(lengths), states.shape[1], device=states.device).index_add_(0, index, states)
        out = sums / torch.tensor(lengths, device=states.device, dtype=torch.float32)[:, None]
    else:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        if pooling.mode == "cls":
            out = states[starts]
        elif pooling.mode == "last":
            out = states[[s + n - 1 for s, n in zip(starts, lengths, strict=True)]]
        else:
            out = torch.stack([states[s : s + n].amax(dim=0) for s, n in zip(starts, lengths, strict=True)])
    return F.normalize(out, p=2, dim=1) if pooling.normalize else out


# Checkpoint name -> this module's name, for the tensors that are not per layer.
_TOP = {
    "embeddings.word_embeddings.weight": "word_embeddings.weight",
    "embeddings.position_embeddings.weight": "position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embed_norm.weight",
    "embeddings.LayerNorm.bias": "embed_norm.bias",
}
_PER_LAYER = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}


def load_encoder(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device) -> BertEncoder:
    """The encoder of a BERT-family directory (safetensors), q|k|v fused per layer."""
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    root = Path(model_dir)
    cfg = load_encoder_config(root)
    model = BertEncoder(cfg)
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(root):
        for name, tensor in load_file(str(path)).items():
            state[name.removeprefix("bert.")] = tensor
    wanted: dict[str, torch.Tensor] = {}
    for source, target in _TOP.items():
        if source not in state:
            raise ModelLoadError(f"{root}: the checkpoint has no {source}")
        wanted[target] = state[source]
    for i in range(cfg.num_layers):
        prefix = f"encoder.layer.{i}."
        try:
            for kind in ("weight", "bias"):
                wanted[f"layers.{i}.qkv.{kind}"] = torch.cat(
                    [state[f"{prefix}attention.self.{p}.{kind}"] for p in ("query", "key", "value")]
                )
                for source, target in _PER_LAYER.items():
                    wanted[f"layers.{i}.{target}.{kind}"] = state[f"{prefix}{source}.{kind}"]
        except KeyError as exc:
            raise ModelLoadError(f"{root}: the checkpoint has no {exc.args[0]}") from exc
    model.load_state_dict(wanted, strict=True)
    return model.to(device=device, dtype=dtype).eval()
