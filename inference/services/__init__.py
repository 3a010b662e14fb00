"""Serving-path services. Views and consumers import from here."""

from __future__ import annotations

from inference.services.deployments import ModelDirectoryError, deployment_register, model_context_limit
from inference.services.generation import (
    ChoiceDelta,
    ChoiceFinished,
    Generation,
    GenerationUsage,
    collect_choices,
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
    "generation_start",
    "model_context_limit",
    "prompt_tokenize",
    "served_model_resolve",
    "ServedModel",
    "Tokenized",
    "tokens_detokenize",
]
