"""A generation body's plan: one planner per wire format (chat, completion, embedding) into the one
GenerationPlan that the generation service runs."""

from inference.services.plans.base import (
    SAMPLING_PARAMS_FIELDS,
    GenerationPlan,
    ServedModel,
    served_model_resolve,
    service_tier_resolve,
)
from inference.services.plans.chat import chat_plan_create
from inference.services.plans.completion import DEFAULT_COMPLETION_MAX_TOKENS, completion_plan_create
from inference.services.plans.embedding import embedding_plan_create

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "SAMPLING_PARAMS_FIELDS",
    "GenerationPlan",
    "ServedModel",
    "chat_plan_create",
    "completion_plan_create",
    "embedding_plan_create",
    "served_model_resolve",
    "service_tier_resolve",
]
