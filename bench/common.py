"""Helpers shared by the engine benchmarks: the cached benchmark model, thread setup, percentiles."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def bench_model_dir(arch: str = "llama", size: str = "bench", dtype: str = "float32", seed: int = 0) -> Path:
    """A model directory from `engine.make_model` (size "bench" is the ~32M-parameter one), built
    once and cached under PAGODA_CACHE_DIR so repeated runs measure the same weights."""
    from engine.make_model import make_model

    root = Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda")) / "models"
    out = root / f"{arch}-{size}-{dtype}-seed{seed}"
    if not (out / "config.json").exists():
        make_model(out, arch=arch, size=size, seed=seed, dtype=dtype)
    return out


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def num_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0-100), as numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def log(message: str) -> None:
    """Progress goes to stderr so that stdout ends with the JSON line alone."""
    print(message, file=sys.stderr, flush=True)
