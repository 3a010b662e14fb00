#!/usr/bin/env bash
# Set up and run the whole platform on this machine: venv, migrations, a demo model, tenant, user
# and key (printed), then web (daphne), one engine worker, celery worker and beat. Ctrl-C stops all.
#
# Zero-config: SQLite (var/db.sqlite3) when DATABASE_URL is unset, an embedded redis-server when
# REDIS_URL is unset. Secrets are generated once into var/ unless SECRET_KEY / API_KEY_PEPPER are set.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
mkdir -p var
[ -f .env ] && set -a && . ./.env && set +a

if [ -z "${SECRET_KEY:-}" ] && [ -z "${SECRET_KEY_FILE:-}" ]; then
  [ -s var/secret_key ] || .venv/bin/python -c "import secrets; print(secrets.token_urlsafe(50))" > var/secret_key
  export SECRET_KEY_FILE=$PWD/var/secret_key
fi
if [ -z "${API_KEY_PEPPER:-}" ] && [ -z "${API_KEY_PEPPER_FILE:-}" ]; then
  [ -s var/api_key_pepper ] || .venv/bin/python -c "import secrets; print(secrets.token_urlsafe(32))" > var/api_key_pepper
  export API_KEY_PEPPER_FILE=$PWD/var/api_key_pepper
fi
export DJANGO_SETTINGS_MODULE=config.settings
PORT=${PORT:-8000}
MODEL_NAME=${PAGODA_DEMO_MODEL:-demo}
MODEL_DIR=${PAGODA_DEMO_MODEL_DIR:-models/demo-llama}
PY=.venv/bin/python

# Start the embedded redis (if REDIS_URL is unset) once, and share it with every process.
if [ -z "${REDIS_URL:-}" ]; then
  export REDIS_URL=$($PY -c "from pathlib import Path; from config.embedded_redis import ensure_embedded_redis; print(ensure_embedded_redis(Path('var').resolve()))")
fi

$PY manage.py migrate --noinput
$PY manage.py collectstatic --noinput >/dev/null
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "Building the demo model in $MODEL_DIR (random weights, locally trained tokenizer)..."
  $PY -m engine make-model --arch llama --size small --out "$MODEL_DIR"
fi
$PY manage.py model_register --name "$MODEL_NAME" --path "$MODEL_DIR"
$PY manage.py create_demo_tenant --models "$MODEL_NAME"

pids=()
cleanup() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
}
trap cleanup INT TERM EXIT

$PY -m daphne -b 127.0.0.1 -p "$PORT" config.asgi:application & pids+=($!)
$PY manage.py run_engine --model "$MODEL_NAME" & pids+=($!)
.venv/bin/celery -A config worker --loglevel=warning --concurrency=1 & pids+=($!)
.venv/bin/celery -A config beat --loglevel=warning --schedule=var/celerybeat-schedule & pids+=($!)

echo
echo "Pagoda is up: http://127.0.0.1:$PORT/dashboard/  (admin: /admin/, API: /v1/, health: /ready)"
echo "Press Ctrl-C to stop every process."
wait -n "${pids[@]}"
