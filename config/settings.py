"""Django settings, read from the environment (see .env.example).

Zero-config local defaults: SQLite when DATABASE_URL is unset, an embedded redis-server when
REDIS_URL is unset. With DEBUG off the process refuses the development SECRET_KEY.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from config.embedded_redis import embedded_redis_url
from config.env import (
    database_from_url,
    envbool,
    envfloat,
    envint,
    envlist,
    envsecret,
    envstr,
    redis_url_checked,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(envstr("PAGODA_VAR_DIR", str(BASE_DIR / "var")))

DEV_SECRET_KEY = "pagoda-development-secret-key-do-not-use-in-production"
DEV_PEPPER = "pagoda-development-api-key-pepper"
# The placeholders of .env.example: a copy of the file left as it is must not start in production.
PLACEHOLDER_SECRET_KEY = "change-me-to-50-random-characters"
PLACEHOLDER_PEPPER = "change-me-too"

DEBUG = envbool("DEBUG", False)
SECRET_KEY = envsecret("SECRET_KEY", DEV_SECRET_KEY)
API_KEY_PEPPER = envsecret("API_KEY_PEPPER", DEV_PEPPER)
if not DEBUG and not envbool("PAGODA_ALLOW_DEV_SECRETS", False):
    if SECRET_KEY in (DEV_SECRET_KEY, PLACEHOLDER_SECRET_KEY):
        raise ImproperlyConfigured(
            "DEBUG is off and SECRET_KEY is the development default or the .env.example placeholder:"
            " set SECRET_KEY (or SECRET_KEY_FILE)."
        )
    if API_KEY_PEPPER in (DEV_PEPPER, PLACEHOLDER_PEPPER):
        raise ImproperlyConfigured(
            "DEBUG is off and API_KEY_PEPPER is the development default or the .env.example placeholder:"
            " set API_KEY_PEPPER."
        )

ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "channels",
    "axes",
    "tenants",
    "inference",
    "batches",
]

MIDDLEWARE = [
    "config.middleware.RequestMetricsMiddleware",
    "config.middleware.ApiErrorShapeMiddleware",
    # Django's own middleware (and CSP's) in an API lane: on /v1 paths the browser-only ones do not
    # run and the rest run inline, without a thread hop per hook (config.middleware._ApiLane).
    "config.middleware.SecurityMiddleware",
    "config.middleware.StaticFilesMiddleware",
    "config.middleware.SessionMiddleware",
    "config.middleware.CommonMiddleware",
    "config.middleware.CsrfViewMiddleware",
    "config.middleware.AuthenticationMiddleware",
    "config.middleware.MessageMiddleware",
    "config.middleware.XFrameOptionsMiddleware",
    "config.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "tenants.sso.sso_context",
            ],
        },
    },
]

_database_url = envstr("DATABASE_URL")
if _database_url:
    DATABASES = {"default": database_from_url(_database_url)}
    _db_pool_max = envint("PAGODA_DB_POOL_MAX", 20, minimum=0)
    if _db_pool_max and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # ASGI runs each request's database work in a thread of its own: without a pool every open
        # request holds a PostgreSQL connection, and a burst exceeds the server's max_connections.
        # With one, a burst waits for one of at most PAGODA_DB_POOL_MAX connections per process (10 s
        # at most: past that the database is taken for down, and the API answers 503).
        DATABASES["default"]["OPTIONS"]["pool"] = {"min_size": 1, "max_size": _db_pool_max, "timeout": 10}
    # A connection is tested as it leaves the pool (or, without one, before a request reuses it),
    # so those a database restart broke are replaced instead of failing the request that drew them.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    # Every ASGI request runs its database work in a thread of its own, so a busy server has many
    # concurrent writers: WAL lets readers go on beside the writer, IMMEDIATE takes the write lock
    # at BEGIN (a read lock upgraded mid-transaction fails at once, ignoring the timeout), and the
    # timeout lets writers queue instead of raising "database is locked".
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "db.sqlite3",
            # A thread's connection to the file stays open (core.concurrency): no server to spare.
            "CONN_MAX_AGE": None,
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }
# Several test runs may share one PostgreSQL server: each gets its own test database.
DATABASES["default"].setdefault("TEST", {})["NAME"] = envstr(
    "PAGODA_TEST_DB_NAME", f"test_pagoda_{os.getpid()}"
)

_redis_url = envstr("REDIS_URL")
# Without REDIS_URL: the embedded redis-server's socket. Importing the settings starts nothing; the
# processes that use Redis start the server (config.embedded_redis.start_if_configured).
EMBEDDED_REDIS = not _redis_url
REDIS_URL = redis_url_checked(_redis_url) if _redis_url else embedded_redis_url(VAR_DIR)
# Every Redis key the platform writes starts with this, so several deployments (or test runs)
# can share one server.
REDIS_PREFIX = envstr("PAGODA_REDIS_PREFIX", "pagoda:")

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": REDIS_PREFIX + "cache",
    }
}

CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
# Seconds a websocket may stay open without authenticating.
WEBSOCKET_AUTH_TIMEOUT = envfloat("PAGODA_WEBSOCKET_AUTH_TIMEOUT", 5.0)

CELERY_BROKER_URL = envstr("CELERY_BROKER_URL", REDIS_URL.replace("unix://", "redis+socket://"))
CELERY_RESULT_BACKEND = None
# The broker's queues are Redis keys too: under the prefix, deployments (and test runs) sharing a
# server never take each other's tasks.
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": REDIS_PREFIX}
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_ACKS_LATE = True
# Batch runners hold a worker process for as long as a tenant's batches run: a queue of their own
# (scripts/up.sh runs a worker for it), so the other tasks never wait behind a batch.
CELERY_TASK_ROUTES = {"batches.tasks.batch_run": {"queue": "batches"}}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A Redis outage of any length: the worker and beat wait for the broker instead of exiting.
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_BEAT_SCHEDULE: dict = {
    # Today's and yesterday's ledger into UsageDaily (idempotent: a late row is picked up next run).
    "tenants-usage-rollup": {
        "task": "tenants.tasks.usage_rollup_recent",
        "schedule": envfloat("PAGODA_USAGE_ROLLUP_EVERY_SECONDS", 300.0),
    },
    # Adapters whose validation was never run (broker down at upload, worker lost mid-check).
    "inference-adapter-validate-lost": {"task": "inference.tasks.adapter_validate_lost", "schedule": 300.0},
    # Stored responses past their expiry.
    "inference-stored-responses-expire": {
        "task": "inference.tasks.stored_responses_expire",
        "schedule": 3600.0,
    },
    # Batches with work left and no runner (a worker died, or the tenant's runner finished another).
    "batches-resume": {
        "task": "batches.tasks.batches_resume",
        "schedule": envfloat("PAGODA_BATCH_RESUME_EVERY_SECONDS", 10.0),
        "options": {"expires": 10.0},
    },
    # Quotas, budgets and rate limits past an alert threshold.
    "tenants-alerts-check": {
        "task": "tenants.tasks.alerts_check",
        "schedule": envfloat("PAGODA_ALERTS_CHECK_EVERY_SECONDS", 60.0),
        "options": {"expires": 60.0},
    },
    # Audit entries past their retention.
    "tenants-audit-purge": {"task": "tenants.tasks.audit_purge", "schedule": 24 * 3600.0},
    # Requests whose web process died, and ledger rows that waited for the database.
    "inference-settlements-sweep": {
        "task": "inference.tasks.settlements_sweep",
        "schedule": 10.0,
        "options": {"expires": 10.0},
    },
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# whitenoise warns on every start while collectstatic has not run yet (tests, a first start).
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
MEDIA_ROOT = Path(envstr("PAGODA_MEDIA_DIR", str(BASE_DIR / "media")))
MODELS_DIR = Path(envstr("PAGODA_MODELS_DIR", str(BASE_DIR / "models")))
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "/dashboard/login/"
LOGIN_REDIRECT_URL = "/dashboard/"
LOGOUT_REDIRECT_URL = "/dashboard/login/"

SECURE_CONTENT_TYPE_NOSNIFF = True
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = CSRF_COOKIE_SAMESITE = "Lax"
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# Served over TLS (a terminating proxy in front): cookies only over HTTPS, and HSTS.
BEHIND_TLS_PROXY = envbool("BEHIND_TLS_PROXY", False)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if BEHIND_TLS_PROXY else None
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = BEHIND_TLS_PROXY
SECURE_HSTS_SECONDS = envint("PAGODA_HSTS_SECONDS", 31_536_000, minimum=0) if BEHIND_TLS_PROXY else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = False

# Content-Security-Policy on every page (django-csp): scripts and styles from this origin only
# (inline style attributes allowed; no inline scripts), no framing, no plugins.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}

# Failed logins (dashboard and admin) are throttled per user name and address (django-axes).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]

# Single sign-on for the dashboard and the admin: OpenID Connect's code flow (mozilla-django-oidc,
# tenants.sso), on when a client id is set. A claim maps the user to tenants and roles
# (tenants.services.sso); password login stays.
OIDC_RP_CLIENT_ID = envstr("PAGODA_OIDC_CLIENT_ID", "") or ""
SSO_ENABLED = bool(OIDC_RP_CLIENT_ID)
OIDC_RP_CLIENT_SECRET = envstr("PAGODA_OIDC_CLIENT_SECRET", "") or ""
OIDC_OP_AUTHORIZATION_ENDPOINT = envstr("PAGODA_OIDC_AUTHORIZATION_ENDPOINT", "") or ""
OIDC_OP_TOKEN_ENDPOINT = envstr("PAGODA_OIDC_TOKEN_ENDPOINT", "") or ""
OIDC_OP_USER_ENDPOINT = envstr("PAGODA_OIDC_USERINFO_ENDPOINT", "") or ""
OIDC_OP_JWKS_ENDPOINT = envstr("PAGODA_OIDC_JWKS_ENDPOINT", "") or ""
OIDC_RP_SIGN_ALGO = envstr("PAGODA_OIDC_SIGN_ALGO", "RS256")
OIDC_RP_SCOPES = "openid email profile"
# Who the identities are from (tenants.models.SsoIdentity); by default the authorization endpoint's origin.
SSO_ISSUER = envstr("PAGODA_OIDC_ISSUER", "") or ""
# {"pagoda_tenants": ["<tenant slug>:<owner|admin|member>", ...], "pagoda_staff": true}
SSO_TENANTS_CLAIM = envstr("PAGODA_OIDC_TENANTS_CLAIM", "pagoda_tenants")
SSO_STAFF_CLAIM = envstr("PAGODA_OIDC_STAFF_CLAIM", "pagoda_staff")
LOGIN_REDIRECT_URL_FAILURE = "/dashboard/login/?sso=failed"
if SSO_ENABLED:
    AUTHENTICATION_BACKENDS.append("tenants.sso.PagodaOIDCBackend")
AXES_FAILURE_LIMIT = envint("PAGODA_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=envint("PAGODA_LOGIN_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "dashboard/locked_out.html"
# Lockouts key on the client's address as the platform's proxy reports it (the PROXY_COUNT-th
# entry of X-Forwarded-For from the right), never on the proxy's own: with that, one stranger could
# lock a named user out for everyone.
PROXY_COUNT = envint("PAGODA_PROXY_COUNT", 1, minimum=1) if BEHIND_TLS_PROXY else 0
AXES_CLIENT_IP_CALLABLE = "core.client_address.client_address"

# The /v1 API (core.api.base.ApiView): who the caller is, and how a request is counted against the
# tenant's requests/min limit. DRF serves the API's input validation (serializers) only.
API_AUTHENTICATE = "tenants.services.api_key_authenticate_header"
API_REQUEST_ADMIT = "tenants.services.request_admit"
# Its OpenAPI schema (GET /v1/openapi.json), generated by drf-spectacular (core.api.openapi).
REST_FRAMEWORK = {"DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}
SPECTACULAR_SETTINGS = {
    "TITLE": "Pagoda API",
    "DESCRIPTION": (
        "OpenAI-compatible inference (chat and text completions, models), the organization's LoRA "
        "adapters and usage, and vLLM's /tokenize and /detokenize."
    ),
    "VERSION": "1",
    "OAS_VERSION": "3.1.0",
    # Request bodies get components of their own (named ...Request): what a request may send
    # (non-blank strings, uploaded files) differs from what a response holds.
    "COMPONENT_SPLIT_REQUEST": True,
    # Operations are tagged by the first path segment after /v1 (models, chat, adapters...).
    "SCHEMA_PATH_PREFIX": r"/(v1/)?",
    # Enums stay inline (no enum components): several fields share a name (`object`) with
    # different values.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enum_id_removal"],
    "ENUM_GENERATE_CHOICE_DESCRIPTION": False,
}

# Platform knobs.
API_KEY_CACHE_SECONDS = envint("PAGODA_API_KEY_CACHE_SECONDS", 30, minimum=0)
ENGINE_HEARTBEAT_TTL = envfloat("PAGODA_ENGINE_HEARTBEAT_TTL", 5.0)
# An engine replica serves GET /live and /ready on this port (for Kubernetes probes); 0: none.
ENGINE_HEALTH_PORT = envint("PAGODA_ENGINE_HEALTH_PORT", 0, minimum=0)
# A web process's requests are settled by others once its owner key is this many seconds old (it
# died), by a settler that sweeps every PAGODA_SETTLER_SWEEP_S (each web process runs one, and
# Celery beat too).
OWNER_TTL_S = envfloat("PAGODA_OWNER_TTL_S", 10.0)
SETTLER_SWEEP_S = envfloat("PAGODA_SETTLER_SWEEP_S", 5.0)
REQUEST_CLAIM_TIMEOUT_MS = envint("PAGODA_REQUEST_CLAIM_TIMEOUT_MS", 15000, minimum=100)
# A stream whose engine replica is lost is continued by another replica at most this many times
# (the engine's --max-failovers); the web tier waits for the continuation at most FAILOVER_WAIT_S.
MAX_FAILOVERS = envint("PAGODA_MAX_FAILOVERS", 2, minimum=0)
FAILOVER_WAIT_S = envfloat("PAGODA_FAILOVER_WAIT_S", 60.0)
OUTPUT_STREAM_TTL = envint("PAGODA_OUTPUT_STREAM_TTL", 600, minimum=10)
# The prompt logprob entries one response may carry (n x prompt tokens x (top logprobs + 1), per
# body part that repeats them): a prompt is paid once, its logprobs are built once per choice.
# The default lets lm-evaluation-harness score prompts of 128k tokens with echo and logprobs 5.
PROMPT_LOGPROB_ENTRIES_MAX = envint("PAGODA_PROMPT_LOGPROB_ENTRIES_MAX", 2_097_152, minimum=1)
# LoRA adapters: the largest upload accepted (bytes, the archive's unpacked content included),
# the highest rank accepted where a deployment's engine_settings name no max_lora_rank, and how
# many adapters one tenant may keep (it also bounds the adapter label of the metrics).
ADAPTER_MAX_BYTES = envint("PAGODA_ADAPTER_MAX_BYTES", 512 * 1024 * 1024, minimum=1)
ADAPTER_MAX_RANK = envint("PAGODA_ADAPTER_MAX_RANK", 64, minimum=1)
ADAPTER_MAX_PER_TENANT = envint("PAGODA_ADAPTER_MAX_PER_TENANT", 50, minimum=1)
# Bytes one tenant's adapters may take in all (their current versions).
ADAPTER_STORAGE_PER_TENANT = envint("PAGODA_ADAPTER_STORAGE_PER_TENANT", 4 * 1024 * 1024 * 1024, minimum=1)
# The Responses API's stored responses (`store`, the default): kept this many days, and at most this
# many bytes per tenant (a `store: true` request past it is refused until some are deleted).
RESPONSES_TTL_DAYS = envint("PAGODA_RESPONSES_TTL_DAYS", 30, minimum=1)
RESPONSES_STORAGE_PER_TENANT = envint("PAGODA_RESPONSES_STORAGE_PER_TENANT", 1024 * 1024 * 1024, minimum=1)
# The Batch API (/v1/files, /v1/batches): bounds on what a tenant may store, how many of a tenant's
# batch lines run at once (one batch of a tenant runs at a time), what a batch token is billed at,
# and the completion window "24h" means (shorter in tests).
BATCH_FILE_MAX_BYTES = envint("PAGODA_BATCH_FILE_MAX_BYTES", 200 * 1024 * 1024, minimum=1)
BATCH_FILE_MAX_LINES = envint("PAGODA_BATCH_FILE_MAX_LINES", 50_000, minimum=1)
BATCH_FILES_MAX_BYTES_PER_TENANT = envint(
    "PAGODA_BATCH_FILES_MAX_BYTES_PER_TENANT", 10 * 1024 * 1024 * 1024, minimum=1
)
BATCH_MAX_IN_FLIGHT = envint("PAGODA_BATCH_MAX_IN_FLIGHT", 8, minimum=1)
BATCH_PRICE_FACTOR = envfloat("PAGODA_BATCH_PRICE_FACTOR", 0.5)
BATCH_COMPLETION_WINDOW_S = envint("PAGODA_BATCH_COMPLETION_WINDOW_S", 24 * 3600, minimum=1)
# How long a batch runner's lease on its tenant lasts without renewal: a runner that died is
# replaced after about this long (by the batches-resume beat task).
BATCH_RUNNER_LEASE_S = envint("PAGODA_BATCH_RUNNER_LEASE_S", 30, minimum=2)
# Bearer token for GET /metrics and the detailed GET /ready (staff sessions need none). Empty: only
# staff may read them; /ready anonymously says ready or not and nothing else.
METRICS_TOKEN = envstr("PAGODA_METRICS_TOKEN", "") or ""
# Days the audit log keeps an entry (a daily task removes older ones).
AUDIT_RETENTION_DAYS = envint("PAGODA_AUDIT_RETENTION_DAYS", 365, minimum=1)

# Alerts (tenants.services.alerts): e-mail through Django's mail backend, and signed webhooks.
EMAIL_BACKEND = envstr("PAGODA_EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = envstr("PAGODA_EMAIL_HOST", "localhost")
EMAIL_PORT = envint("PAGODA_EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = envstr("PAGODA_EMAIL_USER", "") or ""
EMAIL_HOST_PASSWORD = envstr("PAGODA_EMAIL_PASSWORD", "") or ""
EMAIL_USE_TLS = envbool("PAGODA_EMAIL_USE_TLS", False)
DEFAULT_FROM_EMAIL = envstr("PAGODA_EMAIL_FROM", "pagoda@localhost")
# Webhook URLs that resolve to private, loopback or link-local addresses are refused unless this
# is on (a webhook receiver on the operator's own network).
WEBHOOK_ALLOW_PRIVATE = envbool("PAGODA_WEBHOOK_ALLOW_PRIVATE", False)
WEBHOOK_TIMEOUT_S = envfloat("PAGODA_WEBHOOK_TIMEOUT_S", 5.0)
WEBHOOK_MAX_ATTEMPTS = envint("PAGODA_WEBHOOK_MAX_ATTEMPTS", 6, minimum=1)
# A rate-limit refusal (429) is answered after its Retry-After, at most this long: a client that
# ignores Retry-After cannot make the web process refuse it as fast as it can (core.errors).
RATE_LIMIT_HOLD_S = envfloat("PAGODA_RATE_LIMIT_HOLD_S", 1.0)
# The limits a new tenant starts with, finite so that a tenant nobody configured cannot take a whole
# replica; operators change them per tenant in the admin (an empty field there means unlimited).
TENANT_DEFAULT_LIMITS = {
    "requests_per_minute": envint("PAGODA_TENANT_DEFAULT_RPM", 600, minimum=1),
    "tokens_per_minute": envint("PAGODA_TENANT_DEFAULT_TPM", 1_000_000, minimum=1),
    "max_concurrent_requests": envint("PAGODA_TENANT_DEFAULT_CONCURRENCY", 32, minimum=1),
    "monthly_token_quota": envint("PAGODA_TENANT_DEFAULT_MONTHLY_TOKENS", 100_000_000, minimum=1),
    "max_queued_requests": envint("PAGODA_TENANT_DEFAULT_MAX_QUEUED", 64, minimum=1),
    "queue_timeout_seconds": envint("PAGODA_TENANT_DEFAULT_QUEUE_TIMEOUT", 600, minimum=1),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "stream": sys.stderr}},
    "root": {"handlers": ["console"], "level": envstr("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"level": "ERROR"},
        # The pool logs every failed reconnection; the settler and the API say once that the
        # database is down (and a 503 answers each request meanwhile).
        "psycopg.pool": {"level": "ERROR"},
    },
}
