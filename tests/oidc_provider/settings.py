"""Settings of the test identity provider (never the platform's). Its database, signing key and
users' extra claims come from the environment the test starts it with."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

SECRET_KEY = "test-identity-provider-only-not-a-real-secret"
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "oauth2_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.oidc_provider.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [HERE / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("OIDC_PROVIDER_DB", ":memory:"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
LOGIN_URL = "/accounts/login/"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Its own cookie names: the browser keeps one cookie jar per host name, whatever the port.
SESSION_COOKIE_NAME = "idp_sessionid"
CSRF_COOKIE_NAME = "idp_csrftoken"

_key_file = os.environ.get("OIDC_PROVIDER_RSA_KEY_FILE")
OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_RSA_PRIVATE_KEY": Path(_key_file).read_text() if _key_file else "",
    "SCOPES": {"openid": "OpenID Connect", "email": "E-mail", "profile": "Profile"},
    "OAUTH2_VALIDATOR_CLASS": "tests.oidc_provider.validator.ClaimsValidator",
    "PKCE_REQUIRED": False,
}
