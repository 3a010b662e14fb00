"""The bound on the prompt logprobs one response carries.

A prompt is paid for once, but its logprobs are repeated in the response: in each of the n choices
of a completion (the echoed prompt's legacy logprobs, and vLLM's prompt_logprobs), each token with
its top entries. The web process builds and serialises every one of them, so n x prompt tokens x
(k + 1) is what a request costs it, while the sender pays the prompt tokens. Checked once the
prompts are tokenized, before anything is reserved or queued.
"""

from __future__ import annotations

from django.conf import settings

from core.errors import InvalidRequestError
from inference.services.plans import GenerationPlan


def _echoes_logprobs(plan: GenerationPlan) -> bool:
    return plan.kind == "completion" and plan.echo and plan.logprobs is not None


def prompt_logprob_entries(plan: GenerationPlan) -> int:
    """The (token, logprob) entries of the prompts' logprobs in the response: per prompt token the
    token's own entry and its top ones, in every body part that repeats them."""
    per_token = 0
    if _echoes_logprobs(plan):
        per_token += plan.logprobs + 1  # the echoed prompt's legacy logprobs, in each choice
    if plan.prompt_logprobs is not None:
        per_token += plan.prompt_logprobs + 1  # vLLM's prompt_logprobs
    # Completions repeat them in each choice; a chat completion carries prompt_logprobs once.
    copies = plan.n if plan.kind == "completion" else 1
    return copies * plan.prompt_tokens * per_token


def prompt_logprob_volume_check(plan: GenerationPlan) -> None:
    """Refuse (400) a response whose prompt logprobs would exceed PROMPT_LOGPROB_ENTRIES_MAX."""
    limit = settings.PROMPT_LOGPROB_ENTRIES_MAX
    entries = prompt_logprob_entries(plan)
    if entries <= limit:
        return
    # The field that asked for them: logprobs with echo (which sets prompt_logprobs to at least
    # logprobs), unless prompt_logprobs asked for more.
    echoed = _echoes_logprobs(plan)
    param = (
        "logprobs" if echoed and (plan.prompt_logprobs or 0) <= (plan.logprobs or 0) else "prompt_logprobs"
    )
    copies = f"{plan.n} choices x " if plan.kind == "completion" and plan.n > 1 else ""
    raise InvalidRequestError(
        f"The prompt logprobs asked for would be {entries} entries in the response ({copies}"
        f"{plan.prompt_tokens} prompt tokens x the top entries + 1 per token); at most {limit} are "
        "returned per request. Ask for fewer choices, fewer top logprobs or a shorter prompt.",
        param=param,
    )
