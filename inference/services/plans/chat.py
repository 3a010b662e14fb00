"""The chat completion's planner: messages through the model's chat template (with the tools the
tool_choice allows), tool calls forced by a grammar where the tool_choice names or requires one."""

from __future__ import annotations

from typing import Any

from core.errors import InvalidRequestError
from inference import tokenization
from inference.models import ModelDeployment
from inference.services.plans.base import (
    GenerationPlan,
    plan_common,
    sampling_params_for,
    served_model_resolve,
)
from inference.tool_parsers import KEEPS_SPECIAL_TOKENS, named_tool_schema, required_tools_schema
from tenants.types import AuthContext


def chat_plan_create(*, auth: AuthContext, data: dict[str, Any], request_id: str) -> GenerationPlan:
    target = served_model_resolve(auth=auth, model=data["model"])
    deployment = target.deployment
    tools, choice = data.get("tools") or [], data.get("tool_choice") or "none"
    tool_fields = _tool_fields(
        deployment, tools, choice, parallel=data.get("parallel_tool_calls") is not False
    )
    structured = tool_fields.pop("structured", None) or data.get("response_format")
    requested = data.get("max_completion_tokens") or data.get("max_tokens")
    # A bound rather than a demand (Anthropic's max_tokens, which clients set far above a small
    # model's context): cut to what the context leaves after the prompt.
    within_context = bool(data.get("max_tokens_within_context"))
    fits = tokenization.PromptFit(
        max_model_len=deployment.max_model_len,
        completion_tokens=1 if within_context else requested or 1,
        what="messages",
        param="messages",
    )
    prompt = tokenization.chat_prompt_ids(
        deployment.model_path,
        data["messages"],
        tools=tools if choice != "none" else None,
        fits=fits,
        template_kwargs=data.get("chat_template_kwargs"),
    )
    # Without a limit a chat completion may use the rest of the context, as OpenAI's does.
    room = max(deployment.max_model_len - len(prompt), 1)
    max_tokens = min(requested, room) if requested and within_context else requested or room
    fits.check_tokens(len(prompt), max_tokens)
    common = plan_common(auth=auth, data=data, target=target, request_id=request_id)
    n = common["n"]
    logprobs = (data.get("top_logprobs") or 0) if data.get("logprobs") else None
    prompt_logprobs = data.get("prompt_logprobs")
    sampling_params = sampling_params_for(
        data,
        n=n,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        model_path=deployment.model_path,
        structured=structured,
        structured_param="tools"
        if tool_fields.get("tool_mode") in ("named", "required")
        else ("response_format" if data.get("response_format") else "structured_outputs"),
    )
    if tool_fields.get("tool_parser") in KEEPS_SPECIAL_TOKENS:
        # Its calls begin with a special token ([TOOL_CALLS]) that the detokenizer would drop.
        sampling_params["skip_special_tokens"] = False
    return GenerationPlan(
        kind="chat",
        **common,
        prompts=[prompt],
        max_tokens=max_tokens,
        sampling_params=sampling_params,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        # A call forced by a grammar is JSON from its first token: nothing to think in.
        reasoning_parser=deployment.reasoning_parser
        if tool_fields.get("tool_mode") in (None, "auto")
        else "",
        **tool_fields,
    )


def _tool_fields(deployment: ModelDeployment, tools: list, choice: Any, *, parallel: bool) -> dict[str, Any]:
    """The plan's tool fields for a tool_choice, and the grammar ("structured") a forced one needs."""
    if choice == "none" or not tools:
        return {}
    if choice == "auto":
        if not deployment.tool_call_parser:
            raise InvalidRequestError(
                f"The model `{deployment.name}` has no tool call parser configured, so tool_choice auto "
                "is not available; use required or name a function.",
                param="tool_choice",
            )
        return {"tool_mode": "auto", "tool_parser": deployment.tool_call_parser}
    if choice == "required":
        schema = required_tools_schema(tools, parallel=parallel)
        return {"tool_mode": "required", "structured": {"json": schema, "disable_any_whitespace": True}}
    name = choice["function"]["name"]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return {
        "tool_mode": "named",
        "tool_name": name,
        "structured": {"json": named_tool_schema(tool), "disable_any_whitespace": True},
    }
