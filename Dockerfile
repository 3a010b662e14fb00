# One image for every Pagoda process: web (daphne), engine worker, celery worker and beat.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DJANGO_SETTINGS_MODULE=config.settings
WORKDIR /app

RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libpq5 libtcmalloc-minimal4 curl \
 && rm -rf /var/lib/apt/lists/*

COPY requirements.txt ./
# TORCH_SPEC picks the wheel: the CPU build by default; for GPUs, build with
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or whichever CUDA matches the host).
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
RUN pip install --index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple "$TORCH_SPEC" \
 && pip install -r requirements.txt

COPY . .
RUN useradd --create-home --uid 1000 pagoda && mkdir -p /app/var /app/media /app/models \
 && chown -R pagoda /app/var /app/media /app/models
USER pagoda

# collectstatic needs settings that import cleanly; the real secrets come at run time.
RUN SECRET_KEY=build-only-secret-key-not-used-at-runtime API_KEY_PEPPER=build-only-pepper-value \
    REDIS_URL=redis://localhost:6379/0 DATABASE_URL=sqlite:////tmp/build.sqlite3 \
    python manage.py collectstatic --noinput

EXPOSE 8000
# config.web_server: daphne, drained on SIGTERM (open streams finish; see README, Scaling out).
CMD ["python", "-m", "config.web_server", "-b", "0.0.0.0", "-p", "8000", "config.asgi:application"]
