"""The inference app's services: the functions that do its work, called by the /v1 views, the
websocket consumer, the admin, the dashboard and the Celery tasks, which hold no rules of their own.

This package re-exports the generation path (plans, tokenization, `generation_start`); the other
services (adapters, deployments, the settler) are imported from their own modules."""

from __future__ import annotations

from inference.services.deployments import ModelDirectoryError, deployment_register, model_context_limit
from inference.services.generation import (
    ChoiceDelta,
    ChoiceFinished,
    Generation,
    GenerationUsage,
    collect_choices,
    generation_attach,
    generation_start,
)
from inference.services.plans import (
    GenerationPlan,
    ServedModel,
    chat_plan_create,
    completion_plan_create,
    served_model_resolve,
)
from inference.services.tokens import Tokenized, prompt_tokenize, tokens_detokenize

__all__ = [
    "ChoiceDelta",
    "ChoiceFinished",
    "Generation",
    "GenerationPlan",
    "GenerationUsage",
    "ModelDirectoryError",
    "chat_plan_create",
    "collect_choices",
    "completion_plan_create",
    "deployment_register",
    "generation_attach",
    "generation_start",
    "model_context_limit",
    "prompt_tokenize",
    "served_model_resolve",
    "ServedModel",
    "Tokenized",
    "tokens_detokenize",
]
