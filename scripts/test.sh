#!/usr/bin/env bash
# Run the test suite against real PostgreSQL and Redis on this machine. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/services.sh
scripts/system_packages.sh
# Headless Chromium and its driver for the browser tests (Debian packages).
if ! command -v chromedriver >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
    || echo "warning: could not install chromium; browser tests will fail" >&2
fi
# SmolLM2-135M-Instruct for the tests marked real_model: downloaded once, then found in the cache
# (PAGODA_CACHE_DIR, default ~/.cache/pagoda), which outlives the checkout.
.venv/bin/python -m engine fetch-demo-model --out "$(.venv/bin/python -c 'from engine.demo_model import default_model_dir; print(default_model_dir())')" >/dev/null
# all-MiniLM-L6-v2 for the embedding tests, the same way.
.venv/bin/python -m engine fetch-embedding-model --out "$(.venv/bin/python -c 'from engine.demo_model import default_embedding_model_dir; print(default_embedding_model_dir())')" >/dev/null
export DATABASE_URL=${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
export REDIS_URL=${TEST_REDIS_URL:-redis://127.0.0.1:6379/0}
export DEBUG=false PAGODA_ALLOW_DEV_SECRETS=true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
# Triton's interpreter runs the kernels on CPU where there is no GPU; on a GPU they compile for real.
if [ -z "${TRITON_INTERPRET:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  export TRITON_INTERPRET=1
fi
export PAGODA_REDIS_PREFIX=${PAGODA_REDIS_PREFIX:-pagoda-test-$$:}
exec .venv/bin/python -m pytest "$@"
