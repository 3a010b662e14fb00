"""Warming a process up before its first requests: the enabled models' tokenizers loaded (the
transformers import and the tokenizer files), their chat templates compiled and the bound on their
tokens' bytes computed, so that no request waits seconds for them. The web process does it as it
starts (config.web_server, with /ready not ready until it ends); a Celery worker on the `batches`
queue when it is ready."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from django.db import connections

from core.errors import PlatformError
from core.warming import mark_warm, mark_warming
from inference.selectors import deployment_list_enabled
from inference.tokenization import chat_prompt_ids, max_token_bytes, tokenizers_load

logger = logging.getLogger(__name__)

# One short conversation, rendered once per model: compiles its chat template.
_WARM_MESSAGES = [{"role": "user", "content": "Hello."}]


def models_warm() -> int:
    """Load the tokenizers of the enabled models, render each one's chat template once and compute
    the bound on its tokens' bytes (tokenization.max_token_bytes). Returns how many tokenizers
    loaded; one that cannot load is logged, and its requests get the error when they come. Raises
    what the database raises (the caller decides what a failed warm-up means)."""
    try:
        paths = list(dict.fromkeys(d.model_path for d in deployment_list_enabled()))
    finally:
        connections.close_all()  # this thread's
    loaded = tokenizers_load(paths)
    for path in paths:
        # No tokenizer, or no chat template (an embedding model): its requests get the error.
        with contextlib.suppress(PlatformError):
            chat_prompt_ids(path, _WARM_MESSAGES)
        # The bound on a token's bytes reads the whole tokenizer.json (40 ms for SmolLM2's).
        with contextlib.suppress(PlatformError):
            max_token_bytes(path)
    return loaded


def web_warm() -> None:
    """The web process's warm-up, start to end: /ready is not ready until it returns. A failure (the
    database away) ends it too: the requests then load what they need."""
    started = time.monotonic()
    try:
        loaded = models_warm()
    except Exception:
        logger.exception("web warm-up failed; requests load their tokenizers when they come")
    else:
        logger.info("web warm: %d tokenizers loaded in %.1f s", loaded, time.monotonic() - started)
    finally:
        mark_warm()


def web_warm_start() -> None:
    """Start the web process's warm-up in a daemon thread; /ready answers not_ready until it ends."""
    mark_warming()
    threading.Thread(target=web_warm, name="web-warm", daemon=True).start()
