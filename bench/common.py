"""Helpers shared by the engine benchmarks: the cached benchmark model, thread setup, percentiles."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
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


def vllm_env(vllm_python: str, *, threads: int, kv_cache_gib: float) -> dict[str, str]:
    """The environment vLLM's CPU build runs in beside Pagoda: tcmalloc (vLLM's CPU docs ask for
    it; Pagoda's engine processes preload it themselves, see engine.allocator) and the Intel OpenMP
    runtime of its venv preloaded, its threads bound to the first `threads` cores, none reserved."""
    from engine.allocator import tcmalloc_path

    venv = Path(vllm_python).parent.parent
    preload = [p for p in (tcmalloc_path(), str(venv / "lib" / "libiomp5.so")) if p and Path(p).exists()]
    return dict(
        os.environ,
        LD_PRELOAD=":".join(preload),
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        TOKENIZERS_PARALLELISM="false",
    )


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores together, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet_cpu(*, busy_cores: float = 0.3, window_s: float = 0.05, timeout_s: float = 3.0) -> float:
    """Waits until the machine's cores are nearly idle over a short window (at most ``timeout_s``)
    and returns the seconds waited. An engine's OpenMP threads keep spinning for a while after its
    work (Intel's runtime, which vLLM's CPU build runs, for 200 ms by default): a request the other
    engine starts meanwhile shares the cores with them. Where /proc/stat is missing, no wait."""
    if not os.path.exists("/proc/stat"):
        return 0.0
    cores = os.cpu_count() or 1
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        busy0, total0 = _cpu_jiffies()
        time.sleep(window_s)
        busy1, total1 = _cpu_jiffies()
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) * cores <= busy_cores:
            break
    return time.perf_counter() - start


def log(message: str) -> None:
    """Progress goes to stderr so that stdout ends with the JSON line alone."""
    print(message, file=sys.stderr, flush=True)


def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct (float32), fetched once into the cache by `engine.demo_model`."""
    from engine.demo_model import default_model_dir, fetch_demo_model

    return fetch_demo_model(default_model_dir("float32"), dtype="float32")


class PromptSource:
    """Prompt token ids of requested lengths: windows of real text tokenized by the model's own
    tokenizer (the Python standard library's sources, on every machine), or, for random-weight
    models, random ordinary token ids."""

    def __init__(self, model_dir: Path, rng, *, real_text: bool) -> None:
        self.rng = rng
        self.vocab = vocab_size(model_dir)
        self.corpus: list[int] = []
        if real_text:
            import glob
            import sysconfig

            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:60]
            text = "\n".join(Path(f).read_text(errors="replace") for f in files)
            self.corpus = tokenizer.encode(text, add_special_tokens=False)

    def take(self, n: int) -> list[int]:
        if not self.corpus:
            # Ids 0-5 are the special tokens of the made-up models; ordinary ones follow.
            return [self.rng.randrange(6, self.vocab) for _ in range(n)]
        start = self.rng.randrange(0, len(self.corpus) - n)
        return self.corpus[start : start + n]


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) so far of each named process with its descendants (a negative pid:
    that process alone)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, pid in pids.items():
        total = 0
        for member in process_tree(pid) if pid > 0 else [-pid]:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        out[name] = total / tick
    return out
