"""Why a request naming an adapter was refused; the worker turns each into its own error code."""

from __future__ import annotations

from engine.errors import EngineError, InvalidRequestError


class LoRAError(EngineError):
    """Base class of the adapter errors."""


class LoRADisabledError(LoRAError, InvalidRequestError):
    """The request names an adapter but this engine was started without LoRA support."""


class LoRALoadError(LoRAError):
    """The adapter directory cannot be served: missing files, not safetensors, or shapes that do not fit."""
