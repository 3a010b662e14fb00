#!/usr/bin/env bash
# Create .venv (if missing) and install the project's Python dependencies into it. Idempotent:
# reinstalls only when requirements.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first and pinned: on a machine without a GPU this is the local CPU wheel.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
fi
