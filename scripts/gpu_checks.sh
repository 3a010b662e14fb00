#!/usr/bin/env bash
# The checks only a CUDA GPU can run, in one pass, each bounded by a timeout and logged to its own
# file in the output folder (first argument, default ./gpu-logs): the Triton kernels compiled for
# the GPU and the engine against transformers on it (tests marked gpu; the SmolLM2 ones only where
# the model is in the cache), then the GPU benchmarks. Runs with the python on the PATH that has
# torch with CUDA, triton, transformers, safetensors, tokenizers, orjson and pytest; Django is not
# needed. Wheels in .whl/ (say, orjson's, which a GPU image may lack) are installed into a folder of
# their own on the PYTHONPATH first.
#
#     scripts/gpu_checks.sh /tmp/gpu-logs
#     GPU_CHECKS="tests moe" scripts/gpu_checks.sh    # a subset: tests, moe, throughput
#
# GPU_CHECKS_BUDGET_S (default 560) bounds the whole pass: a check whose own limit would end past
# it is skipped, so the logs of those that ran come back within a lease.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-logs}
mkdir -p "$out"
checks=${GPU_CHECKS:-tests moe throughput}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PAGODA_CACHE_DIR=${PAGODA_CACHE_DIR:-/tmp/pagoda-cache}
unset TRITON_INTERPRET

budget=${GPU_CHECKS_BUDGET_S:-560}

if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .whl/*.whl \
    && export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi

run() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  if ((start + limit > budget)); then
    echo "== $name: skipped, ${limit}s would end past the ${budget}s budget (at ${start}s)"
    return
  fi
  echo "== $name (at most ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start))s"
  tail -n 25 "$out/$name.log"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "cores", torch.get_num_threads())'
} 2>&1 | tee "$out/machine.log"

if [[ " $checks " == *" tests "* ]]; then
  marks="gpu"
  $py -c 'from engine.demo_model import default_model_dir; import sys; sys.exit(not (default_model_dir() / "config.json").exists())' \
    || marks="gpu and not real_model"
  parallel=()  # test files spread over 4 processes where pytest-xdist is there (one file, one process)
  $py -c 'import xdist' 2>/dev/null && parallel=(-n 4 --dist loadfile)
  run tests "${GPU_TESTS_S:-300}" $py -m pytest -v -p no:cacheprovider -o addopts="" -m "$marks" \
    --durations=15 "${parallel[@]}" tests/kernels tests/engine/test_cuda.py
fi
if [[ " $checks " == *" moe "* ]]; then
  run moe_mixtral_shape 100 $py bench/moe_experts.py --device cuda --dtype bfloat16 \
    --shape mixtral-8x7b --batches 1,8,64,256,1024 --repeats 20
  run moe_bench_model 50 $py bench/moe_experts.py --device cuda --dtype bfloat16 --repeats 20
fi
if [[ " $checks " == *" throughput "* ]]; then
  for arch in mixtral gemma2; do
    run "throughput_$arch" 100 $py bench/engine_throughput.py --arch "$arch" --device cuda --dtype bfloat16 \
      --num-requests 256 --batch-size 64 --max-num-seqs 64
  done
fi
