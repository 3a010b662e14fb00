"""The completion's planner: one engine request per prompt (text, or token ids), echo with the
prompt's logprobs, and max_tokens 0 for scoring a prompt alone."""

from __future__ import annotations

from typing import Any

from core.errors import InvalidRequestError
from inference import tokenization
from inference.services.plans.base import (
    GenerationPlan,
    plan_common,
    sampling_params_for,
    served_model_resolve,
)
from tenants.types import AuthContext

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def completion_plan_create(*, auth: AuthContext, data: dict[str, Any], request_id: str) -> GenerationPlan:
    target = served_model_resolve(auth=auth, model=data["model"])
    deployment = target.deployment
    vocab = tokenization.vocab_size(deployment.model_path)
    max_tokens = data.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    # max_tokens 0 (with echo: only the prompt is wanted, as lm-eval scores it): the engine runs the
    # prompt and samples one token that is neither returned nor billed.
    engine_max_tokens = max(max_tokens, 1)
    fits = tokenization.PromptFit(
        max_model_len=deployment.max_model_len,
        completion_tokens=engine_max_tokens,
        what="prompt",
        param="prompt",
    )
    prompts: list[list[int]] = []
    for prompt in data["prompt"]:
        if isinstance(prompt, str):
            prompts.append(tokenization.text_prompt_ids(deployment.model_path, prompt, fits=fits))
        else:
            if any(t < 0 or t >= vocab for t in prompt):
                raise InvalidRequestError(f"Token ids must be in [0, {vocab}).", param="prompt")
            prompts.append(prompt)
    for prompt in prompts:
        fits.check_tokens(len(prompt), engine_max_tokens)
    common = plan_common(auth=auth, data=data, target=target, request_id=request_id)
    n = common["n"]
    logprobs = data.get("logprobs")
    echo = bool(data.get("echo"))
    # echo with logprobs scores the prompt's tokens too, as OpenAI's legacy API and vLLM do.
    prompt_logprobs = data.get("prompt_logprobs")
    if echo and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    prompt_texts = []
    if echo:
        tokenizer = tokenization.get_tokenizer(deployment.model_path)
        prompt_texts = [
            p if isinstance(p, str) else tokenizer.decode(t)
            for p, t in zip(data["prompt"], prompts, strict=True)
        ]
    return GenerationPlan(
        kind="completion",
        **common,
        prompts=prompts,
        max_tokens=engine_max_tokens,
        sampling_params=sampling_params_for(
            data,
            n=n,
            max_tokens=engine_max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            model_path=deployment.model_path,
        ),
        logprobs=logprobs,
        echo=echo,
        discard_output=max_tokens == 0,
        prompt_texts=prompt_texts,
        prompt_logprobs=prompt_logprobs,
    )
